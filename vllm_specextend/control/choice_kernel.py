"""The K choice's arithmetic, compiled: Dinkelbach's iteration for every
number of draft steps ``D`` and the pick of the best plan, in plain loops.

Compiled with numba (a dependency of vLLM, whose n-gram proposer,
``vllm/v1/spec_decode/ngram_proposer.py``, runs its per-request batch loop
on the host the same way): per step the choice is hundreds of tiny array
operations on ``[rows]`` arrays, whose per-call overhead numpy cannot hide.

Every sum is the one numpy made before (the choice is bit for bit the same):
a few positions left to right, and from 8 contiguous numbers on numpy's
pairwise summation (:func:`pairwise_sum`). No fastmath, so nothing is
reordered. Compiled once per process (``cache=True`` keeps the machine code
on disk), when a drafter's ``SpeculationControl`` is built (``control/warm_up.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vllm_specextend.common.compiled import compiled
from vllm_specextend.control.cost_model import fixed_seconds

PAIRWISE_FROM = 8
"""numpy sums this many contiguous numbers or more pairwise."""
_PAIRWISE_BLOCK = 128


class StepPrices(NamedTuple):
    """How a step's plans are priced: per number of draft steps ``D``, its
    seconds before its tokens; per drafted token; and under FULL CUDA
    graphs, the drafts per row that keep the step in them (-1: none) and
    what leaving them costs."""

    fixed: np.ndarray
    per_token: float
    uniform_length: int
    piecewise_cost: float


class ChoiceBatch(NamedTuple):
    """What every plan of a choice reads (:func:`_batch`): the rows'
    survival, weighted by their hysteresis ``scale``, by position; the
    expected accepted drafts of a row drafting ``L`` with and without the
    scale; their resumptions; the prices; scratch."""

    survival: np.ndarray
    weighted: np.ndarray
    accepted_table: np.ndarray
    scale: np.ndarray
    resume: np.ndarray
    resumes: bool
    """Some row's resumption costs something (else its sums are skipped)."""
    prices: StepPrices
    position_buffer: np.ndarray
    row_buffer: np.ndarray
    weighted_table: np.ndarray


@compiled
def pairwise_sum(values, n):
    """``values[:n].sum()`` as numpy computes it: an initial 0.0 plus the
    pairwise sum (halves, down to blocks of at most 128 summed by eight
    partial sums), without recursion (numba's cache cannot load recursive
    functions)."""
    if n <= _PAIRWISE_BLOCK:
        return 0.0 + _block_sum(values, 0, n)
    half = n // 2
    half -= half % 8
    if n - half <= _PAIRWISE_BLOCK:
        # One split into two blocks (a batch up to 256): no tree to walk.
        return 0.0 + (_block_sum(values, 0, half) + _block_sum(values, half, n - half))
    # The halves' tree, depth first: per level its start, size, half and
    # the left half's sum once known.
    starts, sizes, halves = np.empty(64, np.int64), np.empty(64, np.int64), np.empty(64, np.int64)
    lefts = np.empty(64)
    left_done = np.zeros(64, np.bool_)
    depth = 0
    starts[0], sizes[0] = 0, n
    while True:
        size = sizes[depth]
        if size > _PAIRWISE_BLOCK:
            half = size // 2
            half -= half % 8
            halves[depth], left_done[depth] = half, False
            starts[depth + 1], sizes[depth + 1] = starts[depth], half
            depth += 1
            continue
        total = _block_sum(values, starts[depth], size)
        depth -= 1
        while depth >= 0 and left_done[depth]:
            total = lefts[depth] + total
            depth -= 1
        if depth < 0:
            return 0.0 + total
        lefts[depth], left_done[depth] = total, True
        starts[depth + 1] = starts[depth] + halves[depth]
        sizes[depth + 1] = sizes[depth] - halves[depth]
        depth += 1


@compiled
def _block_sum(values, start, n):
    """numpy's pairwise sum of at most 128 numbers."""
    if n < 8:
        total = 0.0
        for i in range(start, start + n):
            total += values[i]
        return total
    r0, r1, r2, r3 = values[start], values[start + 1], values[start + 2], values[start + 3]
    r4, r5, r6, r7 = values[start + 4], values[start + 5], values[start + 6], values[start + 7]
    i = 8
    while i < n - n % 8:
        j = start + i
        r0 += values[j]
        r1 += values[j + 1]
        r2 += values[j + 2]
        r3 += values[j + 3]
        r4 += values[j + 4]
        r5 += values[j + 5]
        r6 += values[j + 6]
        r7 += values[j + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        total += values[start + i]
        i += 1
    return total


@compiled
def _goodput(batch, positions, lengths, fixed, weighted):
    """Expected tokens per second of one plan (``lengths``) of ``fixed``
    seconds besides its tokens, over ``positions`` draft positions;
    ``weighted``: accepted drafts divided by the rows' hysteresis scale.
    ``batch``: :func:`_batch`'s."""
    row_buffer, resume, resumes = batch.row_buffer, batch.resume, batch.resumes
    uniform_length = batch.prices.uniform_length
    rows = lengths.shape[0]
    total, count, uniform = 0, 0, True
    for row in range(rows):
        total += lengths[row]
        if resumes and lengths[row] > 0:
            row_buffer[count] = resume[row]
            count += 1
        uniform &= lengths[row] == uniform_length
    resume_sum = pairwise_sum(row_buffer, count) if resumes else 0.0
    for row in range(rows):
        length = lengths[row]
        if positions < PAIRWISE_FROM:
            # (Its sum left to right, over the scale as numpy divided it.)
            table = batch.weighted_table if weighted else batch.accepted_table
            row_buffer[row] = table[row, length]
        else:
            accepted = _accepted(batch.survival, row, positions, length, batch.position_buffer)
            row_buffer[row] = accepted / batch.scale[row] if weighted else accepted
    return _plan_rate(batch, fixed, total, resume_sum, uniform,
                      pairwise_sum(row_buffer, rows), rows)


@compiled
def _accepted(survival, row, positions, length, position_buffer):
    """A row's expected accepted drafts at ``length``, summed pairwise over
    ``positions`` positions (from 8 positions on, as numpy summed them)."""
    for position in range(positions):
        position_buffer[position] = survival[row, position] * (
            1.0 if position < length else 0.0)
    return pairwise_sum(position_buffer, positions)


@compiled
def _plan_rate(batch, fixed, total, resume_sum, uniform, accepted_sum, rows):
    """A plan's expected tokens per second from its sums: ``fixed`` seconds,
    ``total`` drafts, the resumptions' seconds (when the batch's rows
    resume at a cost), whether every row drafts the FULL graphs' length,
    the rows' accepted drafts."""
    prices = batch.prices
    seconds = fixed + prices.per_token * total
    if batch.resumes:
        seconds = seconds + resume_sum
    if prices.uniform_length >= 0:
        seconds = seconds - (prices.piecewise_cost if uniform else 0.0)
    gained = rows + accepted_sum
    return gained / seconds if seconds > 0 else 0.0


@compiled
def _batch(survival, scale, resume, resumes, prices):
    """What every plan's price reads: ``survival`` weighted by ``scale``,
    the expected accepted drafts of a row drafting ``L`` (the sum of its
    first ``L`` survival probabilities, left to right) with and without
    the scale, and scratch."""
    rows, max_k = survival.shape
    weighted = np.empty((max_k, rows))  # by position: the rows' loops run over columns
    accepted_table = np.zeros((rows, max_k + 1))
    for row in range(rows):
        for position in range(max_k):
            weighted[position, row] = survival[row, position] / scale[row]
            accepted_table[row, position + 1] = (accepted_table[row, position]
                                                 + survival[row, position])
    weighted_table = np.empty((rows, max_k + 1))
    for row in range(rows):
        for length in range(max_k + 1):
            weighted_table[row, length] = accepted_table[row, length] / scale[row]
    return ChoiceBatch(survival, weighted, accepted_table, scale, resume, resumes, prices,
                       np.empty(max_k), np.empty(rows), weighted_table)


@compiled
def _solve(batch, positions, steps, fixed, must, has_must, lengths):
    """Dinkelbach on the hysteresis-weighted goodput for ``steps`` draft
    steps: fills ``lengths``, returns the objective. A position is kept
    when it is worth more than its verification time at the current
    goodput (and every position before it is), a row drafts when its kept
    positions are worth more than its resumption. Each round prices its
    plan in the same pass (the sums :func:`_goodput` makes, in its order).
    (Long as one round in one piece: the rows' loops share a dozen scratch
    arrays.)"""
    survival, weighted, scale, resume = batch.survival, batch.weighted, batch.scale, batch.resume
    position_buffer, row_buffer, resumes = batch.position_buffer, batch.row_buffer, batch.resumes
    per_token, uniform_length = batch.prices.per_token, batch.prices.uniform_length
    rows = weighted.shape[1]
    resume_buffer = np.empty(rows)
    chosen_rows, kept_rows, worth_rows = (np.empty(rows, np.int64), np.empty(rows, np.bool_),
                                          np.empty(rows))
    objective = rows / fixed if fixed > 0 else 0.0
    for _ in range(4):  # converges in a few rounds
        current = objective
        threshold = current * per_token
        if positions < PAIRWISE_FROM:
            # Position by position over all rows (branch-free, so compiled
            # to vector code); each row's worth still sums left to right.
            chosen_rows[:] = 0
            kept_rows[:] = True
            worth_rows[:] = 0.0
            for position in range(positions):
                in_steps = position < steps
                for row in range(rows):
                    margin = weighted[position, row] - threshold
                    kept = kept_rows[row] & (margin > 0) & in_steps
                    kept_rows[row] = kept
                    product = margin * (1.0 if kept else 0.0)
                    worth_rows[row] = product if position == 0 else worth_rows[row] + product
                    chosen_rows[row] += kept
        else:
            for row in range(rows):
                chosen, kept = 0, True
                for position in range(positions):
                    margin = weighted[position, row] - threshold
                    kept = kept & (margin > 0) & (position < steps)
                    position_buffer[position] = margin * (1.0 if kept else 0.0)
                    chosen += kept
                chosen_rows[row] = chosen
                worth_rows[row] = pairwise_sum(position_buffer, positions)
        total, resuming, uniform = 0, 0, True
        for row in range(rows):
            chosen = chosen_rows[row]
            # A row drafts when its kept positions are worth its resumption.
            chosen = chosen if worth_rows[row] > (current * resume[row] if resumes else 0.0) else 0
            if has_must and must[row]:
                chosen = 1  # a probe drafts the one token it is priced at
            lengths[row] = chosen
            total += chosen
            if resumes:
                resume_buffer[resuming] = resume[row]
                resuming += chosen > 0
            uniform &= chosen == uniform_length
            if positions < PAIRWISE_FROM:
                row_buffer[row] = batch.weighted_table[row, chosen]
            else:
                row_buffer[row] = _accepted(survival, row, positions, chosen,
                                            position_buffer) / scale[row]
        # The plan's price, as _goodput(batch, positions, lengths, fixed, True).
        new = _plan_rate(batch, fixed, total,
                         pairwise_sum(resume_buffer, resuming) if resumes else 0.0, uniform,
                         pairwise_sum(row_buffer, rows), rows)
        if abs(new - current) <= 1e-9 * max(new, 1.0):
            return current
        objective = new
    return objective


@compiled
def _likeliest(survival, column, must, has_must):
    """``np.argmax(survival[:, column])`` over the rows that do not probe
    (a probe drafts one token): the first maximum (or NaN); -1: none."""
    best, top = -1, 0.0
    for row in range(survival.shape[0]):
        if has_must and must[row]:
            continue
        value = survival[row, column]
        if value != value:
            return row
        if best < 0 or value > top:
            best, top = row, value
    return best


@compiled
def _any(values):
    """``values.any()`` (NaN counts, as numpy's)."""
    for value in values:
        if value != 0:
            return True
    return False


@compiled
def choose_lengths(survival, drafting, resume, must, prices, hysteresis, pause_margin,
                   draft_steps):
    """``(draft lengths, draft steps, expected goodput)`` of the best plan
    over every number of draft steps ``D`` allowed (``draft_steps``; empty:
    all; none but 0 when a row ``must`` draft: draft steps -1), priced by
    ``prices`` (a :class:`StepPrices`). A row that ``must`` draft (a probe)
    drafts exactly one token: what it is priced at. ``resume``: per row,
    what drafting at all adds to the step (empty or all 0: nothing); a plan
    that drafts must beat pausing every row by ``pause_margin``. (Long as
    the whole pick in one pass: solve each ``D``, weigh its plans, keep the
    best.)"""
    rows, max_k = survival.shape
    resumes, has_must = _any(resume), _any(must)
    fixed = prices.fixed
    scale = np.empty(rows)
    for row in range(rows):
        scale[row] = (1.0 - hysteresis) if drafting[row] else (1.0 + hysteresis)
    batch = _batch(survival, scale, resume, resumes, prices)
    lengths = np.zeros(rows, np.int64)
    candidate = np.zeros(rows, np.int64)
    best = np.zeros(rows, np.int64)
    best_value, best_steps = 0.0, -1
    for steps in range(max_k + 1):
        if (has_must and steps == 0) or (draft_steps.size and not draft_steps[steps]):
            continue
        # numpy summed each D on its own positions from 8 positions on.
        positions = max_k if max_k < PAIRWISE_FROM else steps
        if prices.uniform_length == steps and rows:
            # Every row drafting K keeps the step in the FULL graphs.
            candidate[:] = steps
            value = _goodput(batch, positions, candidate, fixed[steps], True)
            if best_steps < 0 or value > best_value:
                best[:] = candidate
                best_value, best_steps = value, steps
        value = _solve(batch, positions, steps, fixed[steps], must, has_must, lengths)
        if steps == 0:
            value = value * (1.0 + pause_margin)
        chosen = lengths
        if steps and (rows == 0 or lengths.max() < steps):
            # D draft steps are only what they cost if a row drafts D: the
            # row likeliest to accept its D-th draft.
            if rows == 0:
                continue
            row = _likeliest(survival, steps - 1, must, has_must)
            if row < 0 or survival[row, steps - 1] <= 0:
                continue
            candidate[:] = lengths
            candidate[row] = steps
            value = _goodput(batch, positions, candidate, fixed[steps], True)
            chosen = candidate
        if best_steps < 0 or value > best_value:
            best[:] = chosen
            best_value, best_steps = value, steps
    if best_steps < 0:
        return best, best_steps, 0.0
    positions = max_k if max_k < PAIRWISE_FROM else best_steps
    return best, best_steps, _goodput(batch, positions, best, fixed[best_steps], False)


@compiled
def choose_step_lengths(survival, drafting, resume, must, costs, settings, shape, draft_steps):
    """:func:`choose_lengths` for a step of ``shape`` (a ``StepShape``),
    priced by the cost model's ``costs`` (a ``StepCosts``) with the
    controller's ``settings`` (a ``ChoiceSettings``), as
    :func:`~vllm_specextend.control.draft_lengths.choose_draft_lengths`
    documents."""
    weights = costs.weights
    max_k = survival.shape[1]
    rows = survival.shape[0]
    graphs = shape.uniform_draft_length >= 0 and costs.piecewise_step
    # Only a batch of decode rows can be a FULL graph's.
    uniform = (shape.uniform_draft_length
               if (graphs and shape.other_tokens == 0 and rows == shape.num_requests) else -1)
    fixed = fixed_seconds(weights, costs.max_draft_steps, shape.num_requests + shape.other_tokens,
                          max_k, settings.free_pause, graphs)
    piecewise_cost = weights[weights.shape[0] - 1] if costs.piecewise_step else 0.0
    prices = StepPrices(fixed, weights[1], uniform, piecewise_cost)
    return choose_lengths(survival, drafting, resume, must, prices, settings.hysteresis,
                          settings.pause_margin, draft_steps)
