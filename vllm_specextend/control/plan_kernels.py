"""The controller's per-row bookkeeping after a plan, compiled with numba
(see ``choice_kernel.py``): a few integer updates per row, one call."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
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


def warm_up_plan_kernels() -> None:
    """Compile (or load) the kernels for the argument types used."""
    ints, flags = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=bool)
    note_plan(ints, ints, flags, flags, ints, ints, ints, ints.copy(), flags.copy(), ints.copy(),
              ints.copy(), ints.copy(), ints.copy(), np.zeros(2, dtype=np.int64), 16, 8)
