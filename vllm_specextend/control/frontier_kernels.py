"""Speculation control's per-row work on draft KV frontiers and blocks,
compiled with numba (see ``choice_kernel.py``): a step's frontiers, its
catch-up, the blocks left lagging or stale. Integers only, so every result
is the numpy reference's exactly.

Per-slot state (a ``FrontierState``: ``frontier``, ``synced``,
``deferred``, ``lagging`` and the lag table) is :class:`SpeculationControl`'s,
updated in place; a step's block table comes as a ``BlockTable``.
"""

from __future__ import annotations

import numpy as np

from vllm_specextend.common.compiled import compiled


@compiled
def block_ranges(table, rows, first, end):
    """The block ids ``table[rows[i], first[i]:end[i]]`` of every ``i``, in
    that order (as a boolean mask over ``table`` picks them, row by row)."""
    width = table.shape[1]
    count = 0
    for i in range(rows.shape[0]):
        count += max(min(end[i], width) - max(first[i], 0), 0)
    blocks = np.empty(count, np.int64)
    count = 0
    for i in range(rows.shape[0]):
        for column in range(max(first[i], 0), min(end[i], width)):
            blocks[count] = table[rows[i], column]
            count += 1
    return blocks


@compiled
def filled_blocks(blocks, slots, context_lens, frontiers, lead, start, stop):
    """The blocks the last forward filled in rows ``start .. stop - 1``:
    from a synced row's frontier to its verified tokens (and ``lead`` more)."""
    frontier, synced, size = frontiers.frontier, frontiers.synced, blocks.size
    rows = np.empty(stop - start, np.int64)
    first, end = np.empty_like(rows), np.empty_like(rows)
    count = 0
    for row in range(start, stop):
        slot = slots[row]
        if synced[slot] and frontier[slot] >= 0:
            rows[count], first[count] = row, frontier[slot] // size
            end[count] = (context_lens[row] + lead) // size
            count += 1
    return block_ranges(blocks.table, rows[:count], first[:count], end[:count])


@compiled
def new_rows(slots, frontiers):
    """Rows whose request is new to the draft (not synced, no frontier yet)."""
    frontier, synced = frontiers.frontier, frontiers.synced
    rows = np.empty(slots.shape[0], np.int64)
    count = 0
    for row in range(slots.shape[0]):
        if not synced[slots[row]] and frontier[slots[row]] < 0:
            rows[count] = row
            count += 1
    return rows[:count]


@compiled
def advance_frontiers(slots, context_lens, prompt_lens, new_starts, frontiers, lead, cap):
    """Each request's frontier after the last step: a synced one's at its
    verified tokens (plus ``lead``), a new one's at ``new_starts`` (in row
    order), one preempted and recomputed at its context; a synced one is no
    longer deferred. Returns per row ``(frontier, gap to catch up (at most
    cap; -1: no cap), deferred)`` and whether a row is prefilling."""
    frontier, synced, deferred = frontiers.frontier, frontiers.synced, frontiers.deferred
    rows = slots.shape[0]
    starts, gaps = np.empty(rows, np.int64), np.empty(rows, np.int64)
    whole = np.empty(rows, np.bool_)
    new, prefilling = 0, False
    for row in range(rows):
        slot, context = slots[row], context_lens[row]
        to = context + lead
        if synced[slot]:
            frontier[slot] = to
            deferred[slot] = False
        elif frontier[slot] < 0:
            frontier[slot] = new_starts[new]
            new += 1
        elif to < frontier[slot]:
            frontier[slot] = context
        starts[row] = frontier[slot]
        gap = max(context - starts[row], 0)
        gaps[row] = gap if cap < 0 else min(gap, cap)
        whole[row] = deferred[slot]
        prefilling |= context < prompt_lens[row]
    return starts, gaps, whole, prefilling


@compiled
def keep_lagging_blocks(slots, blocks, starts, seq_lens, limits, gaps, runs, frontiers):
    """Per request behind its frontier (``starts``) after this step (its
    forward did not run, or its catch-up ``limits`` leave part of its
    ``gaps``; ``limits`` empty: none): its blocks from the frontier's on.
    Every other request is not lagging."""
    lagging, lag_table = frontiers.lagging, frontiers.lag_table
    table, size = blocks.table, blocks.size
    lagging[:] = False
    for row in range(slots.shape[0]):
        behind = starts[row] < seq_lens[row]
        if runs:
            behind &= limits.shape[0] > 0 and limits[row] < gaps[row]
        if behind:
            slot = slots[row]
            lagging[slot] = True
            for column in range(table.shape[1]):
                lag_table[slot, column] = table[row, column]
            frontiers.lag_start[slot] = starts[row] // size
            frontiers.lag_end[slot] = -(-seq_lens[row] // size)


@compiled
def end_step(slots, runs, frontiers, blocks, starts, seq_lens, limits, gaps):
    """After a plan: only the rows of a forward that runs are synced, and
    with block tables kept (``blocks`` has rows) the lagging blocks are kept
    (:func:`keep_lagging_blocks`, of each row's ``seq_lens``: its context
    and query)."""
    synced = frontiers.synced
    synced[:] = False
    if runs:
        for slot in slots:
            synced[slot] = True
    if blocks.table.shape[0]:
        keep_lagging_blocks(slots, blocks, starts, seq_lens, limits, gaps, runs, frontiers)


@compiled
def forget(slots, frontiers):
    """Requests that left: returns the blocks of those left behind their
    frontier (lagging, not synced), and clears their state."""
    lagging, synced = frontiers.lagging, frontiers.synced
    rows = np.empty(slots.shape[0], np.int64)
    count = 0
    for i in range(slots.shape[0]):
        if lagging[slots[i]] and not synced[slots[i]]:
            rows[count] = slots[i]
            count += 1
    rows = rows[:count]
    blocks = block_ranges(frontiers.lag_table, rows, frontiers.lag_start[rows],
                          frontiers.lag_end[rows])
    for slot in slots:
        frontiers.frontier[slot] = -1
        synced[slot], frontiers.deferred[slot], lagging[slot] = False, False, False
    return blocks


@compiled
def catch_up_rows(slots, context_lens, frontiers, cap, limits, budget, blocks):
    """What a first pass catches up per row (see
    ``SpeculationControl.catch_up_starts``): ``(starts, tokens, holes)``,
    ``tokens`` -1 when no row has a gap. Rows their ``limits`` leave behind
    are no longer synced. ``limits``, ``blocks``: empty when none."""
    frontier, synced = frontiers.frontier, frontiers.synced
    table, size = blocks.table, blocks.size
    rows = slots.shape[0]
    full, gaps = np.empty(rows, np.int64), np.empty(rows, np.int64)
    behind = np.zeros(rows, np.bool_)
    total, some = 0, False
    for row in range(rows):
        full[row] = max(context_lens[row] - frontier[slots[row]], 0)
        gaps[row] = full[row] if cap < 0 else min(full[row], cap)
        if limits.shape[0]:
            behind[row] = limits[row] < gaps[row]
            gaps[row] = min(gaps[row], limits[row])
        total += gaps[row]
        some |= gaps[row] != 0
        if behind[row]:
            synced[slots[row]] = False
    if not some:
        return context_lens - gaps, -1, np.empty(0, np.int64)
    if total > budget:
        share = max(budget // rows, 0)
        total = 0
        for row in range(rows):
            gaps[row] = min(gaps[row], share)
            total += gaps[row]
    # Synced with older tokens left out: their blocks turn stale.
    cut = np.empty(rows if table.shape[0] else 0, np.int64)
    count = 0
    for row in range(cut.shape[0]):
        if gaps[row] < full[row] and synced[slots[row]] and not behind[row]:
            cut[count] = row
            count += 1
    cut = cut[:count]
    holes = block_ranges(table, cut, (context_lens[cut] - full[cut]) // size,
                         -(-(context_lens[cut] - gaps[cut]) // size))
    return context_lens - gaps, total, holes
