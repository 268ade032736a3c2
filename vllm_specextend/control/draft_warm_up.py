"""Goodput control's warm-up: the engine's first drafts, which time the
draft's forward for the step-cost model (a number of draft steps never timed
looks free to it).

Once the drafter weighed its draft (:attr:`DraftWarmUp.draft_forward_share`,
at model load), the warm-up is a forced draft like a probe: it waits until
the forced drafts' account (:class:`ForcedDraftAccount`) holds its price
(:meth:`DraftWarmUp.price`: its draft forwards, the verification of its
drafts and its rows' least catch-up, each at most what it can cost), and
is charged what its steps measured. Until then nobody drafts (untimed
drafts would look free) and prompts go through the draft (the warm-up
needs a request the draft is in sync with). Unpriced, the warm-up ran at a
fresh engine's first decode steps: 6% of the first 30 float32 steps of the
issue's Qwen pair (#45), and more where drafting did not pay.
"""

from __future__ import annotations

import numpy as np

from vllm_specextend.control.draft_lengths import DraftPlan
from vllm_specextend.control.forced_account import ForcedDraftAccount

WARM_UP = ("draft", "draft", "pause", "pause")
"""The engine's first plans with decoding rows: two drafting ``K``, one after
the other (the second is timed even where the first follows a prefill; where
the first catches up what its rows' draft missed while it waited, the second
catches up next to nothing, so the cost model tells a draft step from a
caught-up token; fewer draft steps are priced per step until timed; each
waits for a row with no more to catch up than a probe), then two paused."""


class DraftWarmUp:
    """Where the engine is in ``WARM_UP``, and what its drafting plan may cost."""

    def __init__(self, num_speculative_tokens: int, min_catch_up: int) -> None:
        """``min_catch_up``: a row joins the warm-up's draft only with no more
        to catch up than a probe (not a prompt the draft lacks, which it
        would catch up whole)."""
        self.num_speculative_tokens = num_speculative_tokens
        self.min_catch_up = min_catch_up
        self.plans_done = 0
        """``WARM_UP`` entries done (a drafting one once a row drafted in it)."""
        self.draft_forward_share: float | None = None
        """A draft forward's expected seconds over a paused step's (the
        draft's parameters over the target's, set at model load): the price
        of the warm-up's draft before it is timed. None: the warm-up is
        unpriced and drafts at the first decode plan with a row it can
        draft (controllers built without a draft: tests, simulations)."""
        self.planned_now = False
        """Whether the last plan was the warm-up's."""

    @property
    def pending(self) -> bool:
        return self.plans_done < len(WARM_UP)

    @property
    def drafts_left(self) -> bool:
        """Whether a drafting plan of ``WARM_UP`` is still to come."""
        return "draft" in WARM_UP[self.plans_done:]

    @property
    def priced(self) -> bool:
        return self.draft_forward_share is not None

    def price(self, rows: np.ndarray, least: np.ndarray, decoding_rows: int,
              paused_step: float) -> float:
        """Seconds the warm-up's steps may cost beyond paused ones, at most,
        before anything was timed (``rows``: those it drafts; ``least``: per
        row, its least catch-up; ``decoding_rows``: the step's). Per drafting
        plan: ``K`` draft forwards at the draft's share of a paused step, the
        ``K`` drafts of each row verified at a decode row's share of it (a
        step grows with its tokens at most as on a compute-bound CPU) and the
        least catch-up of its rows, a draft's token per token (more, the
        second plan's rows catch up only as their own budgets buy).
        With the draft forwards alone the price was 0.44x what the warm-up
        cost on a 2-core Zen 4 (the Qwen pair at 4 x 3.7K, bf16: charged
        1.13 s against 0.50 s, #45)."""
        share, k = self.draft_forward_share, self.num_speculative_tokens
        row_step = paused_step / max(decoding_rows, 1)
        per_plan = (k * share * paused_step + int(rows.sum()) * k * row_step
                    + float(least[rows].sum()) * share * row_step)
        return WARM_UP.count("draft") * per_plan

    def plan(self, plan: DraftPlan, decoding: np.ndarray, least: np.ndarray,
             paused_step: float, account: ForcedDraftAccount) -> DraftPlan:
        """The plan while the warm-up is pending (``plan``: the choice's;
        ``decoding``, ``least``: per row, decoding and its least catch-up;
        ``paused_step``: the step predicted without drafts). Nobody else
        drafts meanwhile: untimed drafts would look free."""
        paused = DraftPlan(np.zeros_like(plan.draft_lengths), 0, plan.expected_goodput)
        self.planned_now = False
        if WARM_UP[self.plans_done] != "draft":
            self.plans_done += 1
            self.planned_now = True
            return paused
        k = self.num_speculative_tokens
        rows = decoding & (least <= self.min_catch_up)
        if not rows.any():
            return paused  # a warm-up that drafts nothing times nothing (its reserve stays)
        if self.priced and self.plans_done == 0 and not (paused_step > 0.0 and account.affords(
                self.price(rows, least, int(decoding.sum()), paused_step))):
            return paused  # until a paused step was timed and the credit covers the warm-up
        self.plans_done += 1
        self.planned_now = True
        return DraftPlan(np.where(rows, k, 0), k, plan.expected_goodput)
