"""The K choice as numpy computed it before it was compiled: the reference
that ``control/choice_kernel.py`` must equal bit for bit (every sum in
numpy's order; the step's predicted seconds as the compiled cost model sums
them, :func:`fused_dot`)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from vllm_specextend.control.cost_model import NUM_LINEAR_FEATURES, StepCostModel
from vllm_specextend.control.draft_lengths import DraftPlan


def fused_dot(features: np.ndarray, weights: np.ndarray) -> float:
    """``features . weights`` left to right, each term added by one fused
    multiply-add (exact arithmetic, rounded once): the compiled cost
    model's sum (``cost_model.step_seconds``), which numpy's OpenBLAS dot
    also makes below 16 features on FMA hardware."""
    total = 0.0
    for feature, weight in zip(features.tolist(), weights.tolist()):
        total = float(Fraction(feature) * Fraction(weight) + Fraction(total))
    return total


def numpy_choice(
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
    """The numpy choice the compiled one must equal bit for bit."""
    rows, max_k = survival.shape
    must = None if must_draft is None or not must_draft.any() else must_draft
    graphs = uniform_draft_length is not None and cost.piecewise_step
    candidates = [steps for steps in range(max_k + 1)
                  if not ((must is not None and steps == 0)
                          or (draft_steps is not None and not draft_steps[steps]))]
    scale = np.where(drafting, 1.0 - hysteresis, 1.0 + hysteresis)

    def prices(positions: int, steps: list[int]) -> _PlanPrices:
        return _PlanPrices(survival[:, :positions], cost, resume_seconds, steps,
                           num_requests + other_tokens, free_pause, graphs,
                           # Only a batch of decode rows can be a FULL graph's.
                           uniform_draft_length if (graphs and other_tokens == 0
                                                    and rows == num_requests) else None)

    if max_k < 8:
        price = prices(max_k, candidates)
        lengths, objective = _dinkelbach(price, scale, must)
        price_of = [(price, index) for index in range(len(candidates))]
    else:
        # numpy sums 8 or more contiguous numbers pairwise: each D on its
        # own positions then, so that its sums are a loop's over D.
        price_of = [(prices(steps, [steps]), 0) for steps in candidates]
        solved = [_dinkelbach(price, scale, must) for price, _ in price_of]
        lengths = np.concatenate([lengths for lengths, _ in solved])
        objective = np.concatenate([objective for _, objective in solved])
    best = None
    longest = lengths.max(axis=1, initial=0)
    for index, steps in enumerate(candidates):
        price, price_index = price_of[index]
        fixed = price.fixed[price_index]
        if price.uniform_length == steps and rows:
            # Every row drafting K keeps the step in the FULL graphs: worth it
            # when the PIECEWISE step costs more than the extra drafts.
            uniform = np.full(rows, steps, dtype=np.int64)
            value = float(price.goodput(uniform, fixed, scale))
            if best is None or value > best[0]:
                best = (value, uniform, steps, fixed, price)
        chosen, value = lengths[index], float(objective[index])
        if steps == 0:
            value = value * (1.0 + pause_margin)  # drafting must beat pausing by the margin
        if steps and longest[index] < steps:
            # D draft steps are only what they cost if a row drafts D: the
            # row likeliest to accept its D-th draft (at batch 1 the step's
            # cost per D, not the per-token cost, decides).
            # (Not a probing row: a probe drafts one token.)
            eligible = np.ones(rows, dtype=bool) if must is None else ~must
            if not eligible.any():
                continue
            row = int(np.flatnonzero(eligible)[np.argmax(survival[eligible, steps - 1])])
            if survival[row, steps - 1] <= 0:
                continue
            chosen = chosen.copy()
            chosen[row] = steps
            value = float(price.goodput(chosen, fixed, scale))
        if best is None or value > best[0]:
            best = (value, chosen, steps, fixed, price)
    assert best is not None
    _, chosen, steps, fixed, price = best
    return DraftPlan(chosen, steps, float(price.goodput(chosen, fixed)))


class _PlanPrices:
    """Expected goodput of candidate plans (one row of draft lengths per
    number of draft steps ``D``), computed as one plan at a time would be,
    to the last bit: the choice is the same whatever the batching."""

    def __init__(self, survival: np.ndarray, cost: StepCostModel,
                 resume_seconds: np.ndarray | None, candidates: list[int], base_tokens: int,
                 free_pause: bool, graphs: bool, uniform_length: int | None) -> None:
        rows, max_k = survival.shape
        self.survival, self.rows, self.max_k = survival, rows, max_k
        self.per_token = cost.weights[1]  # verified_tokens
        self.piecewise_cost = cost.piecewise_cost
        self.uniform_length = uniform_length
        """The drafts per row that keep a step in the FULL graphs (None: none can)."""
        self.resume = np.zeros(rows) if resume_seconds is None else resume_seconds
        # (A zero resumption adds exactly nothing: its sums are skipped.)
        self.resumes = resume_seconds is not None and bool(resume_seconds.any())
        paused = cost.features(base_tokens, 0, piecewise=graphs)
        self.fixed = np.empty(len(candidates))
        """Per candidate ``D``: the step's seconds before its tokens."""
        for index, steps in enumerate(candidates):
            forwards = steps if (steps or free_pause) else 1
            features = paused.copy()
            if forwards:
                features[NUM_LINEAR_FEATURES - 1 + min(forwards, cost.max_draft_steps)] = 1.0
            self.fixed[index] = fused_dot(features, cost.weights)
        self.candidates = np.array(candidates)
        # Expected accepted drafts of a row drafting L: the sum of its first
        # L survival probabilities, left to right (as numpy sums a few).
        self.accepted_table = None
        if max_k < 8:
            self.accepted_table = np.zeros((max_k + 1, rows))
            for position in range(max_k):
                self.accepted_table[position + 1] = (self.accepted_table[position]
                                                     + survival[:, position])
        self.every_row = np.arange(rows)

    def goodput(self, lengths: np.ndarray, fixed, weights=1.0) -> np.ndarray:
        """Expected tokens per second of ``[..., rows]`` lengths with
        ``fixed`` seconds each (accepted drafts divided by ``weights``)."""
        seconds = fixed + self.per_token * lengths.sum(axis=-1)
        if self.resumes:
            # Summed over the rows that draft alone, as numpy sums one plan's.
            drafts = (lengths > 0).reshape(-1, self.rows)
            seconds = seconds + np.array([self.resume[row].sum() for row in drafts]).reshape(
                lengths.shape[:-1])
        if self.uniform_length is not None:
            seconds = seconds - np.where((lengths == self.uniform_length).all(axis=-1),
                                         self.piecewise_cost, 0.0)
        if self.accepted_table is not None:
            accepted = self.accepted_table[lengths, self.every_row]
        else:
            positions = np.arange(self.max_k)
            accepted = (self.survival * (positions < lengths[..., None])).sum(axis=-1)
        gained = self.rows + (accepted / weights).sum(axis=-1)
        positive = seconds > 0
        if positive.all():
            return gained / seconds
        return np.where(positive, gained / np.where(positive, seconds, 1.0), 0.0)


def _dinkelbach(price: _PlanPrices, scale: np.ndarray,
                must: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``[D, rows]`` lengths and ``[D]`` objectives: Dinkelbach on the
    hysteresis-weighted goodput for every candidate ``D`` at once (a
    drafting row's tokens count 1 / (1 - h), a paused row's 1 / (1 + h)): a
    position is kept when it is worth more than its verification time, a
    row drafts when its kept positions are worth more than its resumption.
    Each ``D`` stops when its iterate converges, as a loop over ``D`` would."""
    fixed, max_k, per_token, resume = price.fixed, price.max_k, price.per_token, price.resume
    objective = np.where(fixed > 0, price.rows / np.where(fixed > 0, fixed, 1.0), 0.0)
    lengths = np.zeros((len(fixed), price.rows), dtype=np.int64)
    in_reach = np.arange(max_k)[None, :] < price.candidates[:, None]  # [D, K]
    weighted = price.survival / scale[:, None]
    # Positions on the middle axis: sums over them add whole rows, in the
    # order numpy sums a few contiguous ones (left to right). From 8
    # positions on, numpy sums contiguous ones pairwise: positions last then.
    axis = 1 if max_k < 8 else 2
    if axis == 1:
        weighted, in_reach = weighted.T[None], in_reach[:, :, None]
    else:
        weighted, in_reach = weighted[None], in_reach[:, None, :]
    active = np.arange(len(fixed))
    reach = in_reach
    for _ in range(4):  # converges in a few rounds
        current = objective[active]
        margins = weighted - (current * per_token)[:, None, None]
        kept = (margins > 0) & reach
        if not max_k:
            worth, chosen = np.zeros(kept.shape[::2]), np.zeros(kept.shape[::2], dtype=np.int64)
        elif axis == 1:
            # Each position only after all before it; the kept positions'
            # margins summed left to right (a short loop over the positions
            # beats numpy's accumulate and reduce over a middle axis).
            worth = margins[:, 0] * kept[:, 0]
            chosen = kept[:, 0].astype(np.int64)
            for position in range(1, max_k):
                kept[:, position] &= kept[:, position - 1]
                worth += margins[:, position] * kept[:, position]
                chosen += kept[:, position]
        else:
            kept = np.logical_and.accumulate(kept, axis=axis)
            worth = (margins * kept).sum(axis=axis)
            chosen = kept.sum(axis=axis)
        worth = worth > (current[:, None] * resume) if price.resumes else worth > 0.0
        chosen *= worth
        if must is not None:
            chosen = np.where(must, 1, chosen)  # a probe drafts one token
        lengths[active] = chosen
        new = price.goodput(chosen, fixed[active], scale)
        converged = np.abs(new - current) <= 1e-9 * np.maximum(new, 1.0)
        objective[active] = np.where(converged, current, new)
        if converged.any():
            if converged.all():
                break
            active = active[~converged]
            reach = in_reach[active]
    return lengths, objective
