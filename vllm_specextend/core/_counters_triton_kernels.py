"""Triton kernel of ``RetrievalStats.record_rows`` on CUDA (see
``core/counters.py``), as a plain function jitted on first use."""

import triton.language as tl


def record_rows_kernel(
    rows_ptr, slots_ptr, seq_lens_ptr, removed_ptr, last_ptr, start_ptr,
    per_slot_ptr, totals_ptr, num_rows,
    BLOCK: tl.constexpr,
):
    """One program: each row's context tokens, kept tokens, verification
    (0 / 1: its query held drafts) and tokens gained at it (accepted drafts
    + 1), added to its slot and to the totals."""
    totals = tl.zeros((4,), tl.int64)
    column = tl.arange(0, 4)
    i = tl.arange(0, BLOCK)
    for start in range(0, num_rows, BLOCK):
        index = start + i
        ok = index < num_rows
        row = tl.load(rows_ptr + index, mask=ok, other=0).to(tl.int64)
        slot = tl.load(slots_ptr + index, mask=ok, other=0).to(tl.int64)
        context = tl.load(seq_lens_ptr + row, mask=ok, other=0).to(tl.int64)
        removed = tl.load(removed_ptr + row, mask=ok, other=0).to(tl.int64)
        first = tl.load(start_ptr + row, mask=ok, other=0).to(tl.int64)
        verified = tl.load(start_ptr + row + 1, mask=ok, other=0).to(tl.int64) - first > 1
        gained = tl.load(last_ptr + row, mask=ok, other=0).to(tl.int64) - first + 1
        gained = tl.where(verified & ok, gained, 0)
        step = tl.where(column[None, :] == 0, context[:, None],
               tl.where(column[None, :] == 1, (context - removed)[:, None],
               tl.where(column[None, :] == 2, (gained > 0).to(tl.int64)[:, None],
                        gained[:, None])))
        step = tl.where(ok[:, None], step, 0)
        target = per_slot_ptr + slot[:, None] * 4 + column[None, :]
        tl.store(target, tl.load(target, mask=ok[:, None], other=0) + step, mask=ok[:, None])
        totals += tl.sum(step, axis=0)
    tl.store(totals_ptr + column, tl.load(totals_ptr + column) + totals)
