"""Triton kernels of ``core/selection_triton.py`` (see its docstring), as
plain functions: ``selection_triton._kernels`` jits them on first use, for
the GPU or for Triton's interpreter. One program per row."""

import triton.language as tl


def select_blocks_kernel(
    score_ptr, order_ptr, recent_ptr, keep_ptr,
    rows_ptr, keep_rows_ptr, seq_lens_ptr, start_ptr,
    score_stride, order_stride, keep_stride,
    num_chunks, num_blocks, top_k, sink_blocks, blocks_per_chunk, recent_tokens, block_size,
    FROM_BATCH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """A row's kept blocks: the sink, everything from the recent window's
    first block, and the blocks of the first ``top_k`` candidate chunks (whole
    chunks between the sink and the recent window, with a finite score) in
    ``order`` (the row's chunks by descending score, stable).

    ``FROM_BATCH``: row ``i`` is batch row ``rows[i]``, whose recent window
    starts ``recent_tokens`` before its query (from ``seq_lens`` and the
    query starts), and its mask is written to ``keep`` row ``keep_rows[i]``;
    else the window's first block is ``recent[i]`` and the mask row ``i``."""
    i = tl.program_id(0).to(tl.int64)
    if FROM_BATCH:
        row = tl.load(rows_ptr + i).to(tl.int64)
        query_len = tl.load(start_ptr + row + 1) - tl.load(start_ptr + row)
        first_query_pos = tl.load(seq_lens_ptr + row) - query_len
        recent = (tl.maximum(first_query_pos - recent_tokens, 0) // block_size).to(tl.int32)
        keep_row = keep_ptr + tl.load(keep_rows_ptr + i).to(tl.int64) * keep_stride
    else:
        recent = tl.load(recent_ptr + i).to(tl.int32)
        keep_row = keep_ptr + i * keep_stride
    b = tl.arange(0, BLOCK_B)
    for start in range(0, num_blocks, BLOCK_B):
        block = start + b
        tl.store(keep_row + block, ((block < sink_blocks) | (block >= recent)).to(tl.int8),
                 mask=block < num_blocks)
    # The picks below write blocks this row's first loop wrote: order them.
    tl.debug_barrier()
    c = tl.arange(0, BLOCK_C)
    picked = tl.zeros((), tl.int32)
    start = 0
    while (start < num_chunks) & (picked < top_k):
        rank = start + c
        in_row = rank < num_chunks
        chunk = tl.load(order_ptr + i * order_stride + rank, mask=in_row, other=0).to(tl.int32)
        score = tl.load(score_ptr + i * score_stride + chunk, mask=in_row, other=0.0)
        candidate = (in_row & ((chunk + 1) * blocks_per_chunk <= recent)
                     & (chunk * blocks_per_chunk >= sink_blocks) & (score > -float("inf")))
        pick = candidate & (picked + tl.cumsum(candidate.to(tl.int32), 0) <= top_k)
        for j in range(blocks_per_chunk):
            block = chunk * blocks_per_chunk + j
            tl.store(keep_row + block, tl.full((BLOCK_C,), 1, tl.int8),
                     mask=pick & (block < num_blocks))
        picked += tl.sum(candidate.to(tl.int32), 0)
        start += BLOCK_C


def compact_block_table_kernel(
    table_ptr, keep_ptr, out_ptr, removed_ptr,
    slot_of_row_ptr, seq_lens_ptr, start_ptr, last_ptr, kept_lens_ptr, per_slot_ptr, totals_ptr,
    table_stride, keep_stride, out_stride,
    num_blocks, block_size, num_reqs, keep_width,
    FROM_SLOTS: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """A row's table with its kept blocks first and the rest after them,
    each in their original order, and the tokens removed.

    ``FROM_SLOTS`` (a decode step's whole plan after selection): the row's
    kept blocks are its request slot's selection (``keep`` row
    ``slot_of_row[row]``, its first ``keep_width`` blocks; later blocks and
    rows without a slot keep everything); it also writes the row's kept
    context length (before its query) and records the step in the slot's
    counters and the totals (as ``RetrievalStats.record_rows``)."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCK_B)
    if FROM_SLOTS:
        slot = tl.load(slot_of_row_ptr + row, mask=row < num_reqs, other=-1).to(tl.int64)
        keep_row = keep_ptr + tl.maximum(slot, 0) * keep_stride
        keep_limit = tl.where(slot >= 0, keep_width, 0)
    else:
        keep_row = keep_ptr + row * keep_stride
        keep_limit = num_blocks
    num_kept = tl.zeros((), tl.int32)
    for start in range(0, num_blocks, BLOCK_B):
        block = start + b
        keep = tl.load(keep_row + block, mask=block < keep_limit, other=1) != 0
        num_kept += tl.sum((keep & (block < num_blocks)).to(tl.int32), 0)
    kept_before = tl.zeros((), tl.int32)
    removed_before = tl.zeros((), tl.int32)
    for start in range(0, num_blocks, BLOCK_B):
        block = start + b
        in_row = block < num_blocks
        keep = tl.load(keep_row + block, mask=block < keep_limit, other=1) != 0
        keep = keep & in_row
        gone = in_row & ~keep
        kept_rank = tl.cumsum(keep.to(tl.int32), 0)
        gone_rank = tl.cumsum(gone.to(tl.int32), 0)
        dest = tl.where(keep, kept_before + kept_rank - 1, num_kept + removed_before + gone_rank - 1)
        value = tl.load(table_ptr + row * table_stride + block, mask=in_row, other=0)
        tl.store(out_ptr + row * out_stride + dest, value, mask=in_row)
        kept_before += tl.sum(keep.to(tl.int32), 0)
        removed_before += tl.sum(gone.to(tl.int32), 0)
    removed = (num_blocks - num_kept) * block_size
    tl.store(removed_ptr + row, removed)
    if FROM_SLOTS:
        if row < num_reqs:
            first = tl.load(start_ptr + row)
            query_len = tl.load(start_ptr + row + 1) - first
            seq_len = tl.load(seq_lens_ptr + row)
            tl.store(kept_lens_ptr + row, seq_len - query_len - removed)
            if slot >= 0:
                gained = tl.where(query_len > 1, tl.load(last_ptr + row) - first + 1, 0)
                step = tl.zeros((4,), tl.int64) + tl.where(
                    tl.arange(0, 4) == 0, seq_len.to(tl.int64), tl.where(
                        tl.arange(0, 4) == 1, (seq_len - removed).to(tl.int64), tl.where(
                            tl.arange(0, 4) == 2, (gained > 0).to(tl.int64),
                            gained.to(tl.int64))))
                target = per_slot_ptr + slot * 4 + tl.arange(0, 4)
                tl.store(target, tl.load(target) + step)
                tl.atomic_add(totals_ptr + tl.arange(0, 4), step)
