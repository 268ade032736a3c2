"""The K choice: per-request draft lengths that maximise expected goodput.

A fractional programme solved by Dinkelbach's iteration for each possible
number of draft steps ``D`` (:func:`choose_draft_lengths`): a request keeps
draft position ``i`` when the probability that it is accepted (the product of
the positions' rates up to ``i``) is worth more than the position's
verification time at the batch's goodput. On the host: the arithmetic is
compiled (:mod:`~vllm_specextend.control.choice_kernel`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from vllm_specextend.common.kernel_args import flags, floats
from vllm_specextend.control.choice_kernel import choose_step_lengths
from vllm_specextend.control.cost_model import StepCostModel
from vllm_specextend.control.kernel_state import ChoiceSettings, StepShape


@dataclass(slots=True)
class DraftPlan:
    """Drafts per request for the next verification, and what it is expected to give."""

    draft_lengths: np.ndarray
    """``[rows]``: drafts per request (0: the request pauses)."""
    draft_steps: int
    """Draft forwards this step runs: the longest ``draft_lengths``."""
    expected_goodput: float
    """Tokens per second the plan is expected to reach (0 if unknown)."""
    catch_up_limits: np.ndarray | None = None
    """``[rows]``: most tokens of its gap (verified while its draft paused)
    each row catches up this step; None: all. A row left short keeps its
    frontier and reads the rest as holes (stale draft KV; the target's
    output does not change) until it drafts on its estimates."""
    draft_prefill: bool = True
    """Whether prompt chunks go through the draft this step when nobody
    drafts (False: a caught-up new request would not draft now either)."""
    runs_draft_forward: bool = True
    """Whether the draft's forward runs this step (False: nobody drafts and
    the drafter catches up later)."""
    deferred_rows: np.ndarray | None = None
    """``[rows]`` bool: rows whose prompt chunks skip the draft this step
    (None: none)."""


class PlannedDraftLengths(Mapping[str, int]):
    """Drafts each request of the last plan keeps, by request id (what the
    runner truncates its drafts to). Kept as the plan's rows: a dictionary
    is built only when looked up by id, and :meth:`rows` answers a batch in
    the plan's order without one."""

    def __init__(self, req_ids: list[str], lengths: np.ndarray) -> None:
        self.req_ids = req_ids
        """The plan's requests (a copy: the runner's list changes in place)."""
        self.lengths = lengths
        self._by_id: dict[str, int] | None = None

    def rows(self, req_ids: list[str]) -> list[int | None]:
        """Per request of ``req_ids``, its drafts (None: not planned)."""
        if req_ids == self.req_ids:
            return self.lengths.tolist()
        return [self.get(req_id) for req_id in req_ids]

    def _dict(self) -> dict[str, int]:
        if self._by_id is None:
            self._by_id = dict(zip(self.req_ids, self.lengths.tolist()))
        return self._by_id

    def __getitem__(self, req_id: str) -> int:
        return self._dict()[req_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self.req_ids)


NO_PLANNED_DRAFT_LENGTHS = PlannedDraftLengths([], np.zeros(0, dtype=np.int64))


def choose_draft_lengths(
    survival: np.ndarray,
    drafting: np.ndarray,
    cost: StepCostModel,
    num_requests: int,
    other_tokens: int = 0,
    free_pause: bool = True,
    hysteresis: float = 0.1,
    pause_margin: float = 0.1,
    must_draft: np.ndarray | None = None,
    resume_seconds: np.ndarray | None = None,
    draft_steps: np.ndarray | None = None,
    uniform_draft_length: int | None = None,
) -> DraftPlan:
    """The draft lengths that maximise expected goodput for the next step.

    Args:
        survival: ``[rows, K]`` acceptance probability of each draft position.
        drafting: ``[rows]`` bool, the row drafted at the previous step
            (hysteresis: a drafting row keeps a position down to
            ``(1 - hysteresis)`` of the threshold, a paused row resumes above
            ``(1 + hysteresis)``).
        pause_margin: a plan that drafts must be expected to beat pausing
            every row by this share.
        cost: the step-cost model.
        num_requests: requests in the next step (prefills included).
        other_tokens: tokens verified besides the decode rows' (prefill chunks).
        free_pause: whether a step with no drafts skips the draft forward
            (otherwise vLLM's first pass still runs once).
        must_draft: ``[rows]`` bool, rows probing this step: they draft
            one token (what a probe is priced at).
        resume_seconds: ``[rows]`` what drafting at all adds to the step for
            a row (its catch-up after a pause, amortised), beyond its tokens.
        draft_steps: ``[K + 1]`` bool, the numbers of draft steps to
            consider (None: all).
        uniform_draft_length: under FULL CUDA graphs, the drafts per
            request that keep the step in them (K); any other plan pays the
            model's ``piecewise_step`` cost, and every row drafting K is
            weighed too. None: no FULL graphs (CPU, eager, PIECEWISE only).

    Each ``D`` is solved by Dinkelbach's iteration (compiled:
    :mod:`~vllm_specextend.control.choice_kernel`); a ``D`` no row would
    draft up to is weighed with its likeliest row drafting ``D``.

    (Long for its arguments' documentation: the body hands the step's
    pricing and the choice to the kernel.)
    """
    lengths, steps, goodput = choose_step_lengths(
        floats(survival), flags(drafting),
        _NO_SECONDS if resume_seconds is None else floats(resume_seconds),
        _NO_FLAGS if must_draft is None else flags(must_draft), cost.kernel_args(),
        ChoiceSettings(float(hysteresis), float(pause_margin), bool(free_pause)),
        StepShape(int(num_requests), int(other_tokens),
                  -1 if uniform_draft_length is None else int(uniform_draft_length)),
        _NO_FLAGS if draft_steps is None else flags(draft_steps))
    assert steps >= 0, "no number of draft steps to choose from"
    return DraftPlan(lengths, steps, goodput)


_NO_FLAGS = np.zeros(0, dtype=bool)
_NO_SECONDS = np.zeros(0)
