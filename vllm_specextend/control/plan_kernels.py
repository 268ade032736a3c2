"""The controller's per-row work around the K choice, compiled with numba
(see ``choice_kernel.py``): before it, the step's rows (what they verify,
decode, may spend on forced drafts, pay to resume); after it, the catch-up
limits and each request's bookkeeping; and the per-slot state of requests
that arrive or leave. One call each, bit for bit the numpy reference (same
operations in the same order per row; no sums of floats).

Per-slot state arrays are :class:`GoodputController`'s, updated in place.
"""

from __future__ import annotations

import numpy as np

from vllm_specextend.common.compiled import compiled
from vllm_specextend.control.acceptance import observe_verified, survival_rows
from vllm_specextend.control.choice_kernel import choose_step_lengths
from vllm_specextend.control.cost_model import NUM_LINEAR_FEATURES, step_seconds

UNLIMITED = np.iinfo(np.int64).max
"""A catch-up limit that is none."""
_MOST_AFFORDABLE = float(UNLIMITED // 2)
_INT64_MIN = np.iinfo(np.int64).min


@compiled
def step_rows(slots, context_lens, query_lens, prompt_lens, graph_query_len, drafted,
              estimates, verification, row_flags):
    """The step's rows, and what the step just verified shows. Per row (in
    ``row_flags[:3]``): whether its query verifies drafts (its prompt was in
    before), whether it decodes after this step, whether it drafted at the
    previous plan. The acceptance ``estimates`` (``AcceptanceEstimates.
    kernel_args``) learn from the drafts verified (``verification``: the
    controller's per-slot ``(context, verified drafts, verified probe,
    probed)``, see :func:`~vllm_specextend.control.acceptance.observe_verified`),
    then give each row's survival into their scratch (0 for rows not
    decoding). Returns the step's tokens, those of rows not decoding,
    whether a row has prompt tokens in this step, and whether every query
    is ``graph_query_len`` long."""
    rows = slots.shape[0]
    verifying, decoding, drafting = row_flags[0], row_flags[1], row_flags[2]
    tokens, other, prefilling, uniform = 0, 0, False, True
    for row in range(rows):
        context, query = context_lens[row], query_lens[row]
        verifying[row] = context >= prompt_lens[row]
        decoding[row] = context + query >= prompt_lens[row]
        drafting[row] = drafted[slots[row]] > 0
        tokens += query
        other += 0 if decoding[row] else query
        prefilling |= not verifying[row]
        uniform &= query == graph_query_len
    rates, engine_rates, smoothing, probe_smoothing, survival = estimates
    last_context, verified_drafts, verified_probe, probed = verification
    observe_verified(rates, engine_rates, slots, context_lens, query_lens, verifying[:rows],
                     last_context, verified_drafts, verified_probe, probed, smoothing,
                     probe_smoothing)
    survival_rows(rates, slots, survival)
    for row in range(rows):
        if not decoding[row]:
            survival[row, :] = 0.0
    return tokens, other, prefilling, uniform


@compiled
def _clip_at_zero(value):
    """``np.maximum(value, 0.0)`` (NaN stays NaN)."""
    return value if (value >= 0.0 or value != value) else 0.0


@compiled
def forward_seconds(weights, draft_steps):
    """The draft forwards of ``draft_steps`` steps: the whole batch's, run
    once for every row that drafts."""
    if not draft_steps:
        return 0.0
    return _clip_at_zero(weights[NUM_LINEAR_FEATURES + draft_steps - 1])


@compiled
def forced_seconds(weights, draft_steps, sharing):
    """What a row's ``draft_steps`` forced drafts add to a step, catch-up
    aside: their verification and its share of the draft forwards, which
    the ``sharing`` rows drafting in the step split."""
    return draft_steps * weights[1] + forward_seconds(weights, draft_steps) / max(sharing, 1)


@compiled
def share_forwards(margins, eligible, forward, sharers, covered):
    """Which ``eligible`` rows draft by force together (into ``covered``):
    the most rows whose ``margins`` (budget left after their own drafts'
    verification and catch-up) each cover an equal share of ``forward``
    seconds, split with ``sharers`` rows that draft anyway. One row alone
    pays the whole forward: a step's draft forward runs for every row
    whether one row drafts or all do. Returns how many."""
    rows = margins.shape[0]
    candidates = np.empty(rows)
    count = 0
    for row in range(rows):
        covered[row] = False
        if eligible[row]:
            candidates[count] = margins[row]
            count += 1
    ranked = np.sort(candidates[:count])[::-1]
    joined = 0
    for index in range(count):
        if ranked[index] >= forward / (index + 1 + sharers):
            joined = index + 1
    if joined == 0:
        return 0
    least = ranked[joined - 1]
    taken = 0
    for row in range(rows):
        if eligible[row] and margins[row] >= least and taken < joined:
            covered[row] = True
            taken += 1
    return joined


@compiled
def affordable(budgets, least, weights, draft_steps, drafting, per_catch_up):
    """``[rows]``: the rows whose budgets cover ``draft_steps`` forced drafts,
    the least catch-up (``least`` tokens at ``per_catch_up`` seconds) and
    an equal share of the draft forwards with the others that join and the
    rows ``drafting`` anyway (:func:`share_forwards`)."""
    rows = budgets.shape[0]
    margins = np.empty(rows)
    eligible = np.empty(rows, np.bool_)
    sharers = 0
    for row in range(rows):
        margins[row] = budgets[row] - draft_steps * weights[1] - per_catch_up * least[row]
        eligible[row] = not drafting[row]
        sharers += drafting[row]
    covered = np.empty(rows, np.bool_)
    share_forwards(margins, eligible, forward_seconds(weights, draft_steps), sharers, covered)
    return covered


@compiled
def catch_up_prices(weights, timed):
    """Seconds per caught-up token, and per token of a forced draft's
    catch-up (see ``ForcedDrafts._catch_up_seconds`` and
    ``_forced_catch_up_seconds``)."""
    verified = weights[1]
    if not timed:
        return verified, 0.0
    learnt = verified if verified < weights[2] else weights[2]  # Python's min(learnt, verified)
    return learnt, learnt


@compiled
def forced_rows(slots, decoding, gaps, whole, state, budget_per_paused_step, min_catch_up,
                timed, probe_interval, weights, per_forced_token, per_token, row_flags,
                row_ints, row_seconds):
    """Per row, what forced drafts may do (see ``ForcedDrafts``, in
    ``control/forced_drafts.py``): whether it probes (``row_flags[3]``), its least
    catch-up, paused plans and probe back-off (``row_ints``), its budget and
    resume seconds (``row_seconds``). ``state``: the controller's per-slot
    ``(paused plans, probe back-off, drafted steps, paused decode steps)``;
    ``gaps``, ``whole``: empty when not given (then no resume seconds)."""
    paused_state, probe_after_state, drafted_steps, paused_decode_steps = state
    probing, least, paused, probe_after = row_flags[3], row_ints[0], row_ints[1], row_ints[2]
    budgets, resume = row_seconds[0], row_seconds[1]
    rows = slots.shape[0]
    margins = np.empty(rows)
    due = np.empty(rows, np.bool_)
    for row in range(rows):
        slot = slots[row]
        paused[row], probe_after[row] = paused_state[slot], probe_after_state[slot]
        budgets[row] = budget_per_paused_step * paused[row]
        least[row] = min_catch_up
        if whole.shape[0] and whole[row]:
            least[row] = max(gaps[row], min_catch_up)
            if not timed:
                budgets[row] = 0.0  # its price unknown, a whole gap is not risked
        due[row] = decoding[row] and paused[row] >= (
            probe_after[row] if probe_after[row] != 0 else probe_interval)
        # A probe drafts one token: its verification and catch-up first.
        margins[row] = budgets[row] - weights[1] - per_forced_token * least[row]
    # Probes due together share the one draft forward they run.
    share_forwards(margins, due, forward_seconds(weights, 1), 0, probing[:rows])
    for row in range(rows):
        slot = slots[row]
        resume[row] = 0.0
        if gaps.shape[0] and not probing[row]:
            horizon = max(drafted_steps[slot] + paused_decode_steps[slot], probe_interval)
            resume[row] = gaps[row] * per_token / horizon


@compiled
def catch_up_limits(lengths, probing, chosen, budgets, least, weights, timed, per_catch_up):
    """Per row, the most tokens of its gap it catches up: all when drafting
    on its estimates, none when paused, and for forced drafts (probing, or
    none chosen) what its budget buys beyond them at ``per_catch_up`` (0:
    unpriced), at least ``least`` (only that until a catch-up was timed)."""
    rows = lengths.shape[0]
    limits = np.empty(rows, np.int64)
    forced = np.empty(rows, np.bool_)
    some = False
    for row in range(rows):
        limits[row] = UNLIMITED if lengths[row] > 0 else 0
        forced[row] = (probing[row] or chosen[row] == 0) and lengths[row] > 0
        some |= forced[row]
    if not some or (timed and not per_catch_up > 0):
        return limits
    drafting = 0
    for row in range(rows):
        drafting += lengths[row] > 0
    for row in range(rows):
        if forced[row] and not timed:
            limits[row] = least[row]
        elif forced[row]:
            left = budgets[row] - forced_seconds(weights, lengths[row], drafting)
            bought = np.floor(_clip_at_zero(left) / per_catch_up)
            if not (bought <= _MOST_AFFORDABLE or bought != bought):
                bought = _MOST_AFFORDABLE
            limits[row] = max(_INT64_MIN if bought != bought else np.int64(bought), least[row])
    return limits


@compiled
def note_plan(slots, lengths, probing, decoding, chosen, paused_steps, probe_after, drafted,
              probed, paused_state, probe_after_state, drafted_steps, paused_decode_steps,
              histogram, probe_interval, max_backoff):
    """Each request's state after a plan of ``lengths`` (per slot: drafts
    planned, probed, consecutive paused plans, probe back-off, decode steps
    drafted and paused) and the plan's decode rows in ``histogram``.

    Drafts not chosen on estimates (probes, warm-up, exploration) weigh as
    probes. A probed request's back-off doubles (up to ``max_backoff``
    intervals); one drafting on its estimates is probed at the interval.
    Returns ``(probes, arrival back-off, whether it changed, decode rows
    drafted, decode rows paused)``: the arrival back-off is the last probed
    or meriting row's."""
    probes, arrival, changed, drafted_rows, paused_rows = 0, 0, False, 0, 0
    for row in range(slots.shape[0]):
        slot, length = slots[row], lengths[row]
        drafts = length > 0
        drafted[slot] = length
        probed[slot] = drafts and (probing[row] or chosen[row] == 0)
        paused_state[slot] = 0 if drafts else paused_steps[row] + 1
        if decoding[row]:
            drafted_steps[slot] += drafts
            paused_decode_steps[slot] += not drafts
            histogram[length] += 1
            drafted_rows += drafts
            paused_rows += not drafts
        is_probe = probing[row] and drafts
        merit = not is_probe and chosen[row] != 0
        after = probe_after[row]
        backed_off = min(2 * (after if after != 0 else probe_interval),
                         max_backoff * probe_interval)
        probe_after_state[slot] = backed_off if is_probe else (0 if merit else after)
        if is_probe or merit:
            arrival, changed = (backed_off if is_probe else 0), True
        probes += is_probe
    return probes, arrival, changed, drafted_rows, paused_rows


@compiled
def start_requests(new, arrival_probe_after, context_len, verified_drafts, drafted, probed,
                   verified_probe, paused_steps, probe_after, drafted_steps,
                   paused_decode_steps, rates, engine_rates):
    """New requests' state: nothing seen or planned, the arrival probe
    back-off, the engine's acceptance estimates."""
    for slot in new:
        context_len[slot], verified_drafts[slot], drafted[slot] = -1, 0, -1
        probed[slot], verified_probe[slot] = False, False
        paused_steps[slot], probe_after[slot] = 0, arrival_probe_after
        drafted_steps[slot], paused_decode_steps[slot] = 0, 0
        rates[slot, :] = engine_rates


@compiled
def paused_fractions(freed, drafted_steps, paused_decode_steps):
    """The share of its decode steps each request that left paused in (those
    with decode steps)."""
    fractions = np.empty(freed.shape[0])
    count = 0
    for slot in freed:
        decode_steps = drafted_steps[slot] + paused_decode_steps[slot]
        if decode_steps:
            fractions[count] = paused_decode_steps[slot] / decode_steps
            count += 1
    return fractions[:count]


@compiled
def settle_plan(slots, lengths, chosen, row_flags, row_ints, row_seconds, weights, timed,
                per_catch_up, state, histogram, probe_interval, max_backoff):
    """:func:`catch_up_limits` and :func:`note_plan` of a plan of ``lengths``
    (``chosen`` on estimates) in one call, from :func:`forced_rows`'s rows;
    ``state``: the controller's per-slot ``(drafts planned, probed, paused
    plans, probe back-off, drafted steps, paused decode steps)``. Returns
    the limits and :func:`note_plan`'s counts."""
    rows = slots.shape[0]
    probing, decoding = row_flags[3, :rows], row_flags[1, :rows]
    least, paused, probe_after = row_ints[0, :rows], row_ints[1, :rows], row_ints[2, :rows]
    limits = catch_up_limits(lengths, probing, chosen, row_seconds[0, :rows], least, weights,
                             timed, per_catch_up)
    drafted, probed, paused_state, probe_after_state, drafted_steps, paused_decode_steps = state
    counts = note_plan(slots, lengths, probing, decoding, chosen, paused, probe_after, drafted,
                       probed, paused_state, probe_after_state, drafted_steps,
                       paused_decode_steps, histogram, probe_interval, max_backoff)
    return limits, counts


@compiled
def plan_rows(slots, gaps, whole, forced_state, plan_state, survival, weights, max_draft_steps,
              piecewise_step, other_tokens, timed, settings, uniform_draft_length, settle,
              row_flags, row_ints, row_seconds, histogram):
    """A step's plan after :func:`step_rows`, in one call: the rows' forced
    drafts (:func:`forced_rows`, their budget from the predicted step
    without drafts), the choice
    (:func:`~vllm_specextend.control.choice_kernel.choose_step_lengths`)
    and, with ``settle`` (no exploration may change the plan), its
    :func:`settle_plan`. ``settings``: ``(probe budget, least probe
    catch-up, probe interval, most probe back-off, hysteresis, pause
    margin, free pause)``; ``forced_state``, ``plan_state``: :func:`forced_rows`'s and
    :func:`settle_plan`'s ``state``. Returns the lengths, draft steps and
    expected goodput, the predicted paused step, whether a row decodes, and
    the limits and counts (empty and zero unless settled)."""
    (probe_budget, min_catch_up, probe_interval, max_backoff, hysteresis, pause_margin,
     free_pause) = settings
    rows = slots.shape[0]
    per_token, per_forced_token = catch_up_prices(weights, timed)
    paused_step = step_seconds(weights, max_draft_steps, rows + other_tokens, 0, 0,
                               piecewise_step)
    if 0.0 > paused_step:  # Python's max(paused_step, 0.0)
        paused_step = 0.0
    decoding = row_flags[1, :rows]
    forced_rows(slots, decoding, gaps, whole, forced_state, probe_budget * paused_step / rows,
                min_catch_up, timed, probe_interval, weights, per_forced_token, per_token,
                row_flags, row_ints, row_seconds)
    resume = row_seconds[1, :rows] if gaps.shape[0] else row_seconds[1, :0]
    lengths, steps, goodput = choose_step_lengths(
        survival, row_flags[2, :rows], weights, max_draft_steps, piecewise_step, rows,
        other_tokens, free_pause, hysteresis, pause_margin, row_flags[1, :0], resume,
        row_flags[3, :rows],
        uniform_draft_length)
    some_decode = False
    for row in range(rows):
        some_decode |= decoding[row]
    limits = np.empty(0, np.int64)
    counts = (0, 0, False, 0, 0)
    if settle:
        limits, counts = settle_plan(slots, lengths, lengths, row_flags, row_ints, row_seconds,
                                     weights, timed, per_forced_token, plan_state, histogram,
                                     probe_interval, max_backoff)
    return lengths, steps, goodput, paused_step, some_decode, limits, counts


def warm_up_plan_kernels() -> None:
    """Compile (or load) the kernels the controller calls, for the argument
    types it passes (those called only from compiled code come with their
    callers)."""
    ints, flags, floats = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=bool), np.zeros(1)
    weights = np.zeros(NUM_LINEAR_FEATURES + 1)
    row_flags, row_ints, row_seconds = (np.zeros((4, 1), dtype=bool),
                                        np.zeros((3, 1), dtype=np.int64), np.zeros((2, 1)))
    step_rows(ints, ints, ints, ints, -1, ints, (np.zeros((1, 1)), floats, 0.2, 0.5,
              np.zeros((1, 1))), (ints.copy(), ints.copy(), flags.copy(), flags), row_flags)
    affordable(floats, ints, weights, 1, flags, 0.0)
    catch_up_prices(weights, False)
    plan_state = (ints.copy(), flags.copy(), ints.copy(), ints.copy(), ints.copy(), ints.copy())
    histogram = np.zeros(2, dtype=np.int64)
    settle_plan(ints, ints, ints, row_flags, row_ints, row_seconds, weights, False, 0.0,
                plan_state, histogram, 16, 8)
    plan_rows(ints, ints, flags, (ints, ints, ints, ints), plan_state, np.zeros((1, 1)),
              weights, 1, False, 0, False, (0.02, 8, 16, 8, 0.1, 0.1, True), -1, True, row_flags,
              row_ints, row_seconds, histogram)
    start_requests(ints, 0, ints.copy(), ints.copy(), ints.copy(), flags.copy(), flags.copy(),
                   ints.copy(), ints.copy(), ints.copy(), ints.copy(), np.zeros((1, 1)), floats)
    paused_fractions(ints, ints, ints)
