"""The controller's per-row work around the K choice, compiled with numba
(see ``choice_kernel.py``): before it, the step's rows (what they verify,
decode, may spend on forced drafts, pay to resume); after it, the catch-up
limits and each request's bookkeeping; and the per-slot state of requests
that arrive or leave. One call each, bit for bit the numpy reference (same
operations in the same order per row; no sums of floats).

They take the controller's state as named records (``kernel_state.py``):
per request slot (``RequestState``, updated in place), per row of the plan
(``RowScratch``), the step's rows (``StepRows``), the acceptance estimates,
the step-cost model's weights (``StepCosts``) and the tuning
(``PlanSettings``).
"""

from __future__ import annotations

import numpy as np

from vllm_specextend.common.compiled import compiled
from vllm_specextend.control.acceptance import observe_verified, survival_rows
from vllm_specextend.control.choice_kernel import choose_step_lengths
from vllm_specextend.control.cost_model import NUM_LINEAR_FEATURES, catch_up_prices, step_seconds
from vllm_specextend.control.kernel_state import StepShape

UNLIMITED = np.iinfo(np.int64).max
"""A catch-up limit that is none."""
_INT64_MIN = np.iinfo(np.int64).min


@compiled
def step_rows(step, graph_query_len, requests, estimates, scratch):
    """The step's rows (``step``, a ``StepRows``), and what the step just
    verified shows. Per row (in ``scratch``): whether its query verifies
    drafts (its prompt was in before), whether it decodes after this step,
    whether it drafted at the previous plan. The acceptance ``estimates``
    learn from the drafts verified (per slot in ``requests``: see
    :func:`~vllm_specextend.control.acceptance.observe_verified`), then give
    each row's survival into their scratch (0 for rows not decoding, and
    past the drafts that can count before its ``max_output_tokens``: a
    request that ends at its next verification drafts nothing).
    Returns the step's tokens, those of rows not in their decode phase,
    whether a row has prompt tokens in this step, and whether every query is
    ``graph_query_len`` long."""
    slots = step.slots
    rows = slots.shape[0]
    verifying, decoding, drafting = scratch.verifying, scratch.decoding, scratch.drafting
    caps = scratch.draft_caps
    max_drafts = estimates.survival.shape[1]
    tokens, other, prefilling, uniform = 0, 0, False, True
    for row in range(rows):
        context, query, prompt = step.context_lens[row], step.query_lens[row], step.prompt_lens[row]
        verifying[row] = context >= prompt
        decodes = context + query >= prompt
        caps[row] = 0
        if decodes:
            # The request's fewest tokens after this step (none of its
            # drafts accepted). The next step verifies drafts + 1 tokens, so
            # drafts beyond its room before max_tokens, less one, never count.
            least_length = context + 2 if verifying[row] else context + query + 1
            room = requests.max_output_tokens[slots[row]] - (least_length - prompt) - 1
            caps[row] = max(0, min(max_drafts, room))
        decoding[row] = caps[row] > 0
        drafting[row] = requests.drafted[slots[row]] > 0
        tokens += query
        other += 0 if decodes else query
        prefilling |= not verifying[row]
        uniform &= query == graph_query_len
    observe_verified(estimates, step, verifying[:rows], requests)
    survival = estimates.survival
    survival_rows(estimates.rates, slots, survival)
    for row in range(rows):
        survival[row, caps[row]:] = 0.0
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
def affordable(budgets, least, weights, draft_steps, drafting, decoding, per_catch_up):
    """``[rows]``: the ``decoding`` rows whose budgets cover ``draft_steps``
    forced drafts, the least catch-up (``least`` tokens at ``per_catch_up``
    seconds) and an equal share of the draft forwards with the others that
    join and the rows ``drafting`` anyway (:func:`share_forwards`). A row
    still in its prompt drafts nothing, so it shares nothing."""
    rows = budgets.shape[0]
    margins = np.empty(rows)
    eligible = np.empty(rows, np.bool_)
    sharers = 0
    for row in range(rows):
        margins[row] = budgets[row] - draft_steps * weights[1] - per_catch_up * least[row]
        eligible[row] = decoding[row] and not drafting[row]
        sharers += drafting[row]
    covered = np.empty(rows, np.bool_)
    share_forwards(margins, eligible, forward_seconds(weights, draft_steps), sharers, covered)
    return covered


@compiled
def forced_catch_up_range(costs, settings):
    """The most tokens a forced draft may catch up: ``catch_up_growth``
    times the most a timed step caught up, ``min_probe_catch_up`` at least.
    A catch-up's price is learnt on the catch-ups timed; a much longer one
    costs more per token than that where the draft's forward turns
    compute-bound (a CPU's: on issue #45's Zen 4 a probe that caught up a
    deferred 4K prompt took seconds, priced at milliseconds)."""
    grown = settings.catch_up_growth * costs.most_catch_up_timed
    return grown if grown > settings.min_probe_catch_up else settings.min_probe_catch_up


@compiled
def forced_rows(step, requests, scratch, settings, costs, budget_per_paused_step):
    """Per row, what forced drafts (probes, warm-up, exploration) may do,
    into ``scratch``: whether it probes, its least catch-up, paused plans
    and probe back-off (from ``requests``), its budget and resume seconds
    (none when the step's ``gaps`` are not given).

    A row's budget is the seconds its next forced drafts may cost:
    ``probe_budget`` of its share of the steps it paused in since it last
    drafted (``budget_per_paused_step`` per paused plan, priced at this
    batch's predicted step without drafts). It catches up
    ``min_probe_catch_up`` tokens at least (all of its gap where it must
    catch up a whole gap, then no budget until a catch-up was timed, nor
    while its gap is beyond :func:`forced_catch_up_range`). Its
    resume seconds: what drafting on its estimates adds to its step,
    catching up its gap once, spread over as many steps as the request has
    decoded (at least a probe interval; it is expected to run about as long
    again), a whole gap's tokens beyond :func:`forced_catch_up_range` at a
    verified token's price at least; a probe's catch-up is its budget's."""
    slots, gaps, whole = step.slots, step.gaps, step.whole
    weights, timed = costs.weights, costs.most_catch_up_timed > 0
    per_token, per_forced_token = catch_up_prices(weights, timed)
    # A whole gap (a prompt the draft lacks: thousands of tokens) beyond the
    # range timed: a token there costs more than those timed; priced at a
    # verified one's, or theirs where dearer.
    per_token_beyond = weights[1] if weights[1] > per_token else per_token
    most_forced = forced_catch_up_range(costs, settings)
    least, paused, probe_after = scratch.least_catch_up, scratch.paused, scratch.probe_after
    budgets, resume, decoding = scratch.budget, scratch.resume, scratch.decoding
    min_catch_up, probe_interval = settings.min_probe_catch_up, settings.probe_interval
    rows = slots.shape[0]
    margins = np.empty(rows)
    due = np.empty(rows, np.bool_)
    for row in range(rows):
        slot = slots[row]
        paused[row], probe_after[row] = requests.paused_steps[slot], requests.probe_after[slot]
        budgets[row] = budget_per_paused_step * paused[row]
        least[row] = min_catch_up
        if whole.shape[0] and whole[row]:
            least[row] = max(gaps[row], min_catch_up)
            if not timed or least[row] > most_forced:
                budgets[row] = 0.0  # its price unknown, a whole gap is not risked
        due[row] = decoding[row] and paused[row] >= (
            probe_after[row] if probe_after[row] != 0 else probe_interval)
        # A probe drafts one token: its verification and catch-up first.
        margins[row] = budgets[row] - weights[1] - per_forced_token * least[row]
    # Probes due together share the one draft forward they run.
    share_forwards(margins, due, forward_seconds(weights, 1), 0, scratch.probing[:rows])
    for row in range(rows):
        slot = slots[row]
        resume[row] = 0.0
        if gaps.shape[0] and not scratch.probing[row]:
            horizon = max(requests.drafted_steps[slot] + requests.paused_decode_steps[slot],
                          probe_interval)
            within = min(gaps[row], most_forced) if whole.shape[0] and whole[row] else gaps[row]
            resume[row] = (within * per_token + (gaps[row] - within) * per_token_beyond) / horizon


@compiled
def catch_up_limits(lengths, chosen, scratch, costs, per_catch_up, most_forced):
    """Per row, the most tokens of its gap it catches up: all when drafting
    on its estimates, none when paused, and for forced drafts (probing, or
    none ``chosen`` on estimates) what its budget buys beyond them at
    ``per_catch_up`` (0: unpriced), up to ``most_forced`` tokens
    (:func:`forced_catch_up_range`), at least its least catch-up (only that
    until a catch-up was timed)."""
    rows = lengths.shape[0]
    probing, budgets, least = scratch.probing, scratch.budget, scratch.least_catch_up
    weights, timed = costs.weights, costs.most_catch_up_timed > 0
    limits = np.empty(rows, np.int64)
    forced = np.empty(rows, np.bool_)
    some = False
    for row in range(rows):
        limits[row] = UNLIMITED if lengths[row] > 0 else 0
        forced[row] = (probing[row] or chosen[row] == 0) and lengths[row] > 0
        some |= forced[row]
    if not some:
        return limits
    drafting = 0
    for row in range(rows):
        drafting += lengths[row] > 0
    for row in range(rows):
        if forced[row] and not timed:
            limits[row] = least[row]
        elif forced[row]:
            bought = float(most_forced)  # a catch-up learnt free: the range
            if per_catch_up > 0:
                left = budgets[row] - forced_seconds(weights, lengths[row], drafting)
                bought = np.floor(_clip_at_zero(left) / per_catch_up)
            if not (bought <= most_forced or bought != bought):
                bought = float(most_forced)
            limits[row] = max(_INT64_MIN if bought != bought else np.int64(bought), least[row])
    return limits


@compiled
def note_plan(slots, lengths, chosen, scratch, requests, histogram, settings):
    """Each request's state after a plan of ``lengths`` (``chosen`` on
    estimates; per slot in ``requests``: drafts planned, probed, consecutive
    paused plans, probe back-off, decode steps drafted and paused) and the
    plan's decode rows in ``histogram``.

    Drafts not chosen on estimates (probes, warm-up, exploration) weigh as
    probes. A probed request's back-off doubles (up to ``max_probe_backoff``
    intervals); one drafting on its estimates is probed at the interval.
    Returns ``(probes, arrival back-off, whether it changed, decode rows
    drafted, decode rows paused)``: the arrival back-off is the last probed
    or meriting row's."""
    probing, decoding = scratch.probing, scratch.decoding
    paused_steps, probe_after = scratch.paused, scratch.probe_after
    probe_interval, max_backoff = settings.probe_interval, settings.max_probe_backoff
    probes, arrival, changed, drafted_rows, paused_rows = 0, 0, False, 0, 0
    for row in range(slots.shape[0]):
        slot, length = slots[row], lengths[row]
        drafts = length > 0
        requests.drafted[slot] = length
        requests.probed[slot] = drafts and (probing[row] or chosen[row] == 0)
        requests.paused_steps[slot] = 0 if drafts else paused_steps[row] + 1
        if decoding[row]:
            requests.drafted_steps[slot] += drafts
            requests.paused_decode_steps[slot] += not drafts
            histogram[length] += 1
            drafted_rows += drafts
            paused_rows += not drafts
        is_probe = probing[row] and drafts
        merit = not is_probe and chosen[row] != 0
        after = probe_after[row]
        backed_off = min(2 * (after if after != 0 else probe_interval),
                         max_backoff * probe_interval)
        requests.probe_after[slot] = backed_off if is_probe else (0 if merit else after)
        if is_probe or merit:
            arrival, changed = (backed_off if is_probe else 0), True
        probes += is_probe
    return probes, arrival, changed, drafted_rows, paused_rows


@compiled
def start_requests(new, arrival_probe_after, requests, estimates):
    """New requests' state: nothing seen or planned, the arrival probe
    back-off, the engine's acceptance estimates."""
    for slot in new:
        requests.context_len[slot], requests.verified_drafts[slot] = -1, 0
        requests.drafted[slot] = -1
        requests.probed[slot], requests.verified_probe[slot] = False, False
        requests.paused_steps[slot], requests.probe_after[slot] = 0, arrival_probe_after
        requests.drafted_steps[slot], requests.paused_decode_steps[slot] = 0, 0
        requests.max_output_tokens[slot] = UNLIMITED
        estimates.rates[slot, :] = estimates.engine_rates


@compiled
def paused_fractions(freed, requests):
    """The share of its decode steps each request that left paused in (those
    with decode steps)."""
    fractions = np.empty(freed.shape[0])
    count = 0
    for slot in freed:
        decode_steps = requests.drafted_steps[slot] + requests.paused_decode_steps[slot]
        if decode_steps:
            fractions[count] = requests.paused_decode_steps[slot] / decode_steps
            count += 1
    return fractions[:count]


@compiled
def settle_plan(slots, lengths, chosen, scratch, costs, requests, histogram, settings):
    """:func:`catch_up_limits` and :func:`note_plan` of a plan of ``lengths``
    (``chosen`` on estimates) in one call, from :func:`forced_rows`'s rows.
    Returns the limits and :func:`note_plan`'s counts."""
    per_forced_token = catch_up_prices(costs.weights, costs.most_catch_up_timed > 0)[1]
    limits = catch_up_limits(lengths, chosen, scratch, costs, per_forced_token,
                             forced_catch_up_range(costs, settings))
    counts = note_plan(slots, lengths, chosen, scratch, requests, histogram, settings)
    return limits, counts


@compiled
def plan_rows(step, requests, scratch, estimates, costs, settings, shape, histogram):
    """A step's plan after :func:`step_rows`, in one call: the rows' forced
    drafts (:func:`forced_rows`, their budget from the predicted step
    without drafts), the choice
    (:func:`~vllm_specextend.control.choice_kernel.choose_step_lengths`) and,
    unless an exploration may change the plan (``shape``: a ``PlanShape``),
    its :func:`settle_plan`. Returns the lengths, draft steps and expected
    goodput, the predicted paused step, whether a row decodes, and the limits
    and counts (empty and zero unless settled)."""
    slots = step.slots
    rows = slots.shape[0]
    weights = costs.weights
    paused_step = step_seconds(weights, costs.max_draft_steps, rows + shape.other_tokens, 0, 0,
                               costs.piecewise_step)
    if 0.0 > paused_step:  # Python's max(paused_step, 0.0)
        paused_step = 0.0
    decoding = scratch.decoding[:rows]
    forced_rows(step, requests, scratch, settings, costs,
                settings.probe_budget * paused_step / rows)
    resume = scratch.resume[:rows] if step.gaps.shape[0] else scratch.resume[:0]
    lengths, steps, goodput = choose_step_lengths(
        estimates.survival[:rows], scratch.drafting[:rows], resume, scratch.probing[:rows],
        costs, settings.choice, StepShape(rows, shape.other_tokens, shape.uniform_draft_length),
        scratch.decoding[:0])
    some_decode = False
    for row in range(rows):
        some_decode |= decoding[row]
    limits = np.empty(0, np.int64)
    counts = (0, 0, False, 0, 0)
    if shape.settle:
        limits, counts = settle_plan(slots, lengths, lengths, scratch, costs, requests,
                                     histogram, settings)
    return lengths, steps, goodput, paused_step, some_decode, limits, counts
