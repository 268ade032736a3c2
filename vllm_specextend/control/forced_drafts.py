"""Drafts not chosen on estimates (probes, warm-up, exploration): what
they may cost, what catching up is priced at, and the plans they make.

:class:`ForcedDrafts` is mixed into
:class:`~vllm_specextend.control.goodput.GoodputController` and reads its
fields (``parameters``, ``cost``, ``stats``, the per-slot arrays); split out
only to keep the controller's module short.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from vllm_specextend.control.cost_model import NUM_LINEAR_FEATURES
from vllm_specextend.control.draft_lengths import DraftPlan

WARM_UP_PLANS = {0: "warm-up", 1: "warm-up", 2: "pause", 3: "pause"}
UNLIMITED = np.iinfo(np.int64).max


class ForcedDrafts:
    """The :class:`GoodputController` methods that price and plan forced
    drafts and catch-up."""

    def _probe_budgets(self, paused_steps: np.ndarray, num_requests: int,
                       paused_step: float) -> np.ndarray:
        """``[rows]``: seconds each request's next forced drafts (a probe, an
        exploration) may cost: ``probe_budget`` of its share of the steps it
        paused in since it last drafted (``paused_step``: this batch's
        predicted step without drafts)."""
        return (self.parameters.probe_budget * paused_step / num_requests
                * paused_steps.astype(np.float64))

    def _resume_seconds(self, slots: np.ndarray, gaps: np.ndarray | None,
                        probing: np.ndarray) -> np.ndarray | None:
        """``[rows]``: what drafting on its estimates adds to a row's step:
        catching up its gap, once, spread over as many steps as the request
        has decoded (at least a probe interval; it is expected to run about
        as long again). A probe's catch-up is its budget's."""
        if gaps is None:
            return None
        decoded = self._drafted_steps[slots] + self._paused_decode_steps[slots]
        horizon = np.maximum(decoded, self.parameters.probe_interval)
        return np.where(probing, 0.0, gaps * self._catch_up_seconds() / horizon)

    def _forced_draft_seconds(self, draft_lengths: np.ndarray | int,
                              num_requests: int) -> np.ndarray:
        """What a row's forced drafts add to a step, catch-up aside: their
        verification and the row's share of the draft forwards."""
        weights = self.cost.weights
        per_steps = weights[NUM_LINEAR_FEATURES:NUM_LINEAR_FEATURES + self.num_speculative_tokens]
        forwards = np.maximum(np.concatenate(([0.0], per_steps)), 0.0)
        return draft_lengths * weights[1] + forwards[draft_lengths] / num_requests

    def _catch_up_seconds(self) -> float:
        """Seconds per caught-up token: learnt once a catch-up was timed, at
        most a verified token's (a draft's token costs no more than the
        target's: one small catch-up's step can put all its noise on its
        few tokens); before, a verified token's, so resumptions and prompts
        are not priced as free."""
        verified = float(self.cost.weights[1])
        return min(float(self.cost.weights[2]), verified) if self._catch_up_timed else verified

    def _forced_catch_up_seconds(self) -> float:
        """Seconds per token a forced draft's catch-up is priced at: none
        until a catch-up was timed, since the engine's first forced drafts
        catch up only ``min_probe_catch_up`` tokens, which times the price.
        (A verified token's price overstates it where the steps cannot tell
        the base from a token: at batch 1, half of a paused step. A whole
        gap is not forced before: ``plan``'s ``whole_catch_up``.)"""
        return self._catch_up_seconds() if self._catch_up_timed else 0.0

    def _affordable(self, budgets: np.ndarray, draft_steps: int, num_requests: int,
                    least: np.ndarray) -> np.ndarray:
        """``[rows]``: the budget covers ``draft_steps`` forced drafts and
        the least catch-up (``least`` tokens)."""
        return budgets >= (self._forced_draft_seconds(draft_steps, num_requests)
                           + self._forced_catch_up_seconds() * least)

    def _limit_catch_up(self, plan: DraftPlan, forced: np.ndarray, budgets: np.ndarray,
                        num_requests: int, least: np.ndarray) -> DraftPlan:
        """Catch-up limits: a row drafting on its estimates catches up all of
        its gap, a paused row none, a row drafting by force (probe, warm-up,
        exploration) what its budget buys beyond its drafts, and at least
        ``least`` (only that until a catch-up was timed)."""
        lengths = plan.draft_lengths
        limits = np.where(lengths > 0, UNLIMITED, 0)
        forced = forced & (lengths > 0)
        per_catch_up = self._forced_catch_up_seconds()
        if forced.any() and not self._catch_up_timed:
            limits = np.where(forced, least, limits)
        elif forced.any() and per_catch_up > 0:
            left = budgets - self._forced_draft_seconds(lengths, num_requests)
            affordable = np.floor(np.maximum(left, 0.0) / per_catch_up)
            allowance = np.maximum(np.minimum(affordable, UNLIMITED // 2).astype(np.int64),
                                   least)
            limits = np.where(forced, allowance, limits)
        return replace(plan, catch_up_limits=limits)

    def _explore(self, plan: DraftPlan, decoding: np.ndarray, budgets: np.ndarray,
                 num_requests: int, least: np.ndarray) -> DraftPlan:
        """Warm-up: two plans at full K, then two with no drafts; after that,
        every ``explore_interval`` plans, one that departs from the choice:
        every row drafting D (D cycling through 1..K) or, while some rows
        draft, every other time none. The cost model then keeps seeing every
        number of draft steps. A row not drafting on its estimates joins an
        exploring draft only when its probe budget covers it (the
        exploration waits for one that does)."""
        if not decoding.any():
            return plan
        kind = WARM_UP_PLANS.get(self._plans)
        if kind is None:
            self._since_exploration += 1
            if self._since_exploration < self.parameters.explore_interval:
                return plan
            pause = plan.draft_steps > 0 and self.stats.explorations % 2 == 0
            kind = "pause" if pause else "draft"
        if kind == "warm-up":
            lengths = np.where(decoding, self.num_speculative_tokens, 0)
            return DraftPlan(lengths, self.num_speculative_tokens, plan.expected_goodput)
        if kind == "draft":
            steps = 1 + (self.stats.explorations // 2) % self.num_speculative_tokens
            rows = decoding & ((plan.draft_lengths > 0)
                               | self._affordable(budgets, steps, num_requests, least))
            if not rows.any():
                return plan  # until a budget covers it
            plan = DraftPlan(np.where(rows, steps, 0), steps, plan.expected_goodput)
        else:
            plan = DraftPlan(np.zeros_like(plan.draft_lengths), 0, plan.expected_goodput)
        if self._plans not in WARM_UP_PLANS:
            self.stats.explorations += 1
            self._since_exploration = 0
        return plan
