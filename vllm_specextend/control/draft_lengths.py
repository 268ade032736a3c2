"""The K choice: per-request draft lengths that maximise expected goodput.

A fractional programme solved by Dinkelbach's iteration for each possible
number of draft steps ``D`` (:func:`choose_draft_lengths`): a request keeps
draft position ``i`` when the probability that it is accepted (the product of
the positions' rates up to ``i``) is worth more than the position's
verification time at the batch's goodput. On the host: the arithmetic is
compiled (:mod:`~vllm_specextend.control.choice_kernel`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_specextend.control.choice_kernel import choose_lengths
from vllm_specextend.control.cost_model import NUM_LINEAR_FEATURES, StepCostModel
from vllm_specextend.control.kernel_args import flags, floats


@dataclass(frozen=True)
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


def choose_draft_lengths(
    survival: np.ndarray,
    drafting: np.ndarray,
    cost: StepCostModel,
    num_requests: int,
    other_tokens: int = 0,
    free_pause: bool = True,
    hysteresis: float = 0.1,
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
        cost: the step-cost model.
        num_requests: requests in the next step (prefills included).
        other_tokens: tokens verified besides the decode rows' (prefill chunks).
        free_pause: whether a step with no drafts skips the draft forward
            (otherwise vLLM's first pass still runs once).
        must_draft: ``[rows]`` bool, rows probing this step: they draft at
            least one token.
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

    (Long for its arguments' documentation: the body prices the step and
    hands the choice to the kernel.)
    """
    rows, max_k = survival.shape
    graphs = uniform_draft_length is not None and cost.piecewise_step
    # Only a batch of decode rows can be a FULL graph's.
    uniform = (uniform_draft_length if (graphs and other_tokens == 0 and rows == num_requests)
               else -1)
    lengths, steps, goodput = choose_lengths(
        floats(survival), flags(drafting), float(hysteresis),
        _fixed_seconds(cost, num_requests + other_tokens, max_k, free_pause, graphs),
        _NO_FLAGS if draft_steps is None else flags(draft_steps), np.float64(cost.weights[1]),
        _NO_SECONDS if resume_seconds is None else floats(resume_seconds),
        _NO_FLAGS if must_draft is None else flags(must_draft), int(uniform),
        float(cost.piecewise_cost))
    assert steps >= 0, "no number of draft steps to choose from"
    return DraftPlan(lengths, steps, goodput)


_NO_FLAGS = np.zeros(0, dtype=bool)
_NO_SECONDS = np.zeros(0)


def _fixed_seconds(cost: StepCostModel, base_tokens: int, max_k: int, free_pause: bool,
                   graphs: bool) -> np.ndarray:
    """``[K + 1]``: per number of draft steps ``D``, the step's predicted
    seconds before its drafts' tokens (``free_pause``: no draft forward at
    ``D = 0``)."""
    features = cost.features(base_tokens, 0, piecewise=graphs)
    fixed = np.empty(max_k + 1)
    for steps in range(max_k + 1):
        forwards = steps if (steps or free_pause) else 1
        column = NUM_LINEAR_FEATURES - 1 + min(forwards, cost.max_draft_steps)
        if forwards:
            features[column] = 1.0
        fixed[steps] = float(cost.predict(features))
        if forwards:
            features[column] = 0.0
    return fixed
