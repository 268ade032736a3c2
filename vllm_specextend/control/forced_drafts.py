"""Drafts not chosen on estimates (probes, warm-up, exploration): what
they may cost, what catching up is priced at, and the plans they make.

:class:`ForcedDrafts` is mixed into
:class:`~vllm_specextend.control.goodput.GoodputController` and reads its
fields (``parameters``, ``cost``, ``stats``, the per-slot arrays); split out
only to keep the controller's module short.
"""

from __future__ import annotations

import numpy as np

from vllm_specextend.common.kernel_args import flags, floats
from vllm_specextend.control.draft_lengths import DraftPlan
from vllm_specextend.control.plan_kernels import UNLIMITED, affordable, catch_up_prices

__all__ = ["UNLIMITED", "WARM_UP", "ForcedDrafts"]

WARM_UP = ("draft", "draft", "pause", "pause")
"""The engine's first plans with decoding rows: two drafting ``K`` (the second
is timed even where the first follows a prefill; fewer draft steps are priced
per step until timed), then two paused."""


class ForcedDrafts:
    """The :class:`GoodputController` methods that price and plan forced
    drafts and catch-up.

    Per row, what forced drafts may do (computed in the controller's plan,
    :func:`~vllm_specextend.control.plan_kernels.forced_rows`): a row's
    budget is the seconds its next forced drafts (a probe, an exploration)
    may cost: ``probe_budget`` of its share of the steps it paused in since
    it last drafted (priced at this batch's predicted step without drafts).
    It catches up ``min_probe_catch_up`` tokens at least (all of its gap
    where it must catch up a whole gap, then no budget until a catch-up was
    timed). It probes when decoding, its paused plans reach its back-off (or
    the probe interval) and the budget covers a draft and that catch-up.
    Its resume seconds: what drafting on its estimates adds to its step,
    catching up its gap once, spread over as many steps as the request has
    decoded (at least a probe interval; it is expected to run about as long
    again); a probe's catch-up is its budget's."""

    def _catch_up_seconds(self) -> float:
        """Seconds per caught-up token: learnt once a catch-up was timed, at
        most a verified token's (a draft's token costs no more than the
        target's: one small catch-up's step can put all its noise on its
        few tokens); before, a verified token's, so resumptions and prompts
        are not priced as free."""
        return float(catch_up_prices(self.cost.weights, self._catch_up_timed)[0])

    def _forced_catch_up_seconds(self) -> float:
        """Seconds per token a forced draft's catch-up is priced at: none
        until a catch-up was timed, since the engine's first forced drafts
        catch up only ``min_probe_catch_up`` tokens, which times the price.
        (A verified token's price overstates it where the steps cannot tell
        the base from a token: at batch 1, half of a paused step. A whole
        gap is not forced before: ``plan``'s ``whole_catch_up``.)"""
        return float(catch_up_prices(self.cost.weights, self._catch_up_timed)[1])

    def _affordable(self, budgets: np.ndarray, draft_steps: int, drafting: np.ndarray,
                    decoding: np.ndarray, least: np.ndarray) -> np.ndarray:
        """``[rows]``: the ``decoding`` rows not ``drafting`` anyway whose
        budgets cover ``draft_steps`` forced drafts, the least catch-up
        (``least`` tokens) and their share of the draft forwards (split with
        the rows that join and those drafting: ``plan_kernels.share_forwards``)."""
        return affordable(budgets, least, floats(self.cost.weights), draft_steps,
                          flags(drafting), flags(decoding), self._forced_catch_up_seconds())

    def _explore(self, plan: DraftPlan, decoding: np.ndarray, budgets: np.ndarray,
                 least: np.ndarray) -> DraftPlan:
        """Warm-up (``WARM_UP``; a warm-up row joins only with no more than
        ``min_probe_catch_up`` tokens to catch up: not a prompt the draft
        lacks); after that, every ``explore_interval`` plans, one that
        departs from the choice: every row drafting D (D cycling through
        1..K) or, while some rows draft, every other time none. The cost
        model then keeps seeing every number of draft steps. A row not
        drafting on its estimates joins an exploring draft only when its
        probe budget covers it (the exploration waits for one that does)."""
        if not decoding.any():
            return plan
        if self._warm_up_plans < len(WARM_UP):
            drafts = WARM_UP[self._warm_up_plans] == "draft"
            self._warm_up_plans += 1
            # Unpriced: a row joins with no more to catch up than a probe
            # would (not a prompt the draft lacks, which it would catch up whole).
            rows = decoding & (least <= self.parameters.min_probe_catch_up) & drafts
            steps = self.num_speculative_tokens if rows.any() else 0
            return DraftPlan(np.where(rows, steps, 0), steps, plan.expected_goodput)
        self._since_exploration += 1
        if self._since_exploration < self.parameters.explore_interval:
            return plan
        if plan.draft_steps > 0 and self.stats.explorations % 2 == 0:
            plan = DraftPlan(np.zeros_like(plan.draft_lengths), 0, plan.expected_goodput)
        else:
            steps = 1 + (self.stats.explorations // 2) % self.num_speculative_tokens
            drafting = plan.draft_lengths > 0
            rows = decoding & (
                drafting | self._affordable(budgets, steps, drafting, decoding, least))
            if not rows.any():
                return plan  # until a budget covers it
            plan = DraftPlan(np.where(rows, steps, 0), steps, plan.expected_goodput)
        self.stats.explorations += 1
        self._since_exploration = 0
        return plan
