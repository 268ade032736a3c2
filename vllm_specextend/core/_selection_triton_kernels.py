"""Triton kernels of ``core/selection_triton.py`` (see its docstring), as
plain functions: ``selection_triton._kernels`` jits them on first use, for
the GPU or for Triton's interpreter (this module is imported then, so its
helper is jitted after TRITON_INTERPRET is read). One program per row.
Kernel bodies run to 65-76 lines: each is one program's loop over a row,
with its pointer arithmetic, and reads best in one piece."""

import triton
import triton.language as tl


@triton.jit
def _candidate_keys(score_row, chunk, num_chunks, recent, sink_blocks, blocks_per_chunk,
                    BY_POSITION: tl.constexpr):
    """Each chunk's score as an integer in the scores' order (0 .. 2^32 - 1),
    -1 where the chunk is no candidate: not a whole chunk between the sink
    and the recent window, or scored -inf. ``BY_POSITION``: the chunk's
    index is its score (streaming: the most recent chunks win)."""
    in_row = chunk < num_chunks
    if BY_POSITION:
        key = chunk.to(tl.int64)
        finite = in_row
    else:
        score = tl.load(score_row + chunk, mask=in_row, other=0.0)
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with 0.0, as in a sort
        bits = score.to(tl.int32, bitcast=True)
        # Flip the magnitude of negatives: the integers then order as the floats.
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = ordered.to(tl.int64) + 2147483648
        finite = in_row & (score > -float("inf"))
    candidate = (finite & ((chunk + 1) * blocks_per_chunk <= recent)
                 & (chunk * blocks_per_chunk >= sink_blocks))
    return tl.where(candidate, key, -1)


def select_blocks_kernel(
    score_ptr, recent_ptr, keep_ptr, rows_ptr, keep_rows_ptr, seq_lens_ptr, start_ptr,
    score_stride, keep_stride,
    num_chunks, num_blocks, top_k, sink_blocks, blocks_per_chunk, recent_tokens, block_size,
    FROM_BATCH: tl.constexpr, BY_POSITION: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """A row's kept blocks: the sink, everything from the recent window's
    first block, and the blocks of its ``top_k`` best candidate chunks
    (whole chunks between the sink and the recent window, with a finite
    score; ties go to the earlier chunk).

    The top-k without a sort: a radix select finds the k-th best key bit by
    bit (32 counting passes over the row's scores), then the chunks above it
    and the earliest of those equal to it are picked.

    ``FROM_BATCH``: row ``i`` is batch row ``rows[i]``, whose recent window
    starts ``recent_tokens`` before its query (from ``seq_lens`` and the
    query starts); its scores and its mask are row ``keep_rows[i]`` of
    ``score`` and ``keep`` (request slots). Else the window's first block is
    ``recent[i]`` and the rows are ``i``."""
    i = tl.program_id(0).to(tl.int64)
    if FROM_BATCH:
        row = tl.load(rows_ptr + i).to(tl.int64)
        query_len = tl.load(start_ptr + row + 1) - tl.load(start_ptr + row)
        first_query_pos = tl.load(seq_lens_ptr + row) - query_len
        recent = (tl.maximum(first_query_pos - recent_tokens, 0) // block_size).to(tl.int32)
        out_row = tl.load(keep_rows_ptr + i).to(tl.int64)
    else:
        recent = tl.load(recent_ptr + i).to(tl.int32)
        out_row = i
    keep_row = keep_ptr + out_row * keep_stride
    score_row = score_ptr + out_row * score_stride
    b = tl.arange(0, BLOCK_B)
    for start in range(0, num_blocks, BLOCK_B):
        block = start + b
        tl.store(keep_row + block, ((block < sink_blocks) | (block >= recent)).to(tl.int8),
                 mask=block < num_blocks)
    c = tl.arange(0, BLOCK_C)
    num_candidates = tl.zeros((), tl.int32)
    for start in range(0, num_chunks, BLOCK_C):
        key = _candidate_keys(score_row, start + c, num_chunks, recent, sink_blocks,
                              blocks_per_chunk, BY_POSITION)
        num_candidates += tl.sum((key >= 0).to(tl.int32), 0)
    k = tl.minimum(num_candidates, top_k)
    # The k-th best key: the largest threshold that k keys reach.
    threshold = tl.zeros((), tl.int64)
    for n in range(32):
        trial = threshold | (tl.full((), 1, tl.int64) << (31 - n))
        reaching = tl.zeros((), tl.int32)
        for start in range(0, num_chunks, BLOCK_C):
            key = _candidate_keys(score_row, start + c, num_chunks, recent, sink_blocks,
                                  blocks_per_chunk, BY_POSITION)
            reaching += tl.sum((key >= trial).to(tl.int32), 0)
        threshold = tl.where(reaching >= k, trial, threshold)
    above = tl.zeros((), tl.int32)
    for start in range(0, num_chunks, BLOCK_C):
        key = _candidate_keys(score_row, start + c, num_chunks, recent, sink_blocks,
                              blocks_per_chunk, BY_POSITION)
        above += tl.sum((key > threshold).to(tl.int32), 0)
    # The picks write blocks the first loop wrote: order them.
    tl.debug_barrier()
    ties_before = tl.zeros((), tl.int32)
    for start in range(0, num_chunks, BLOCK_C):
        chunk = start + c
        key = _candidate_keys(score_row, chunk, num_chunks, recent, sink_blocks,
                              blocks_per_chunk, BY_POSITION)
        tie = (key == threshold) & (key >= 0)
        tie_rank = ties_before + tl.cumsum(tie.to(tl.int32), 0)
        # (k = 0: the threshold is 2^32 - 1, which no key exceeds.)
        pick = (key > threshold) | (tie & (tie_rank <= k - above))
        for j in range(blocks_per_chunk):
            block = chunk * blocks_per_chunk + j
            tl.store(keep_row + block, tl.full((BLOCK_C,), 1, tl.int8),
                     mask=pick & (block < num_blocks))
        ties_before += tl.sum(tie.to(tl.int32), 0)


def compact_block_table_kernel(
    table_ptr, keep_ptr, out_ptr, removed_ptr,
    slot_of_row_ptr, seq_lens_ptr, start_ptr, last_ptr, kept_lens_ptr, per_slot_ptr, totals_ptr,
    table_stride, keep_stride, out_stride,
    num_blocks, block_size, num_reqs, keep_width,
    FROM_SLOTS: tl.constexpr, RECORD: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """A row's table with its kept blocks first and the rest after them,
    each in their original order, and the tokens removed.

    ``FROM_SLOTS`` (a decode step): the row's kept blocks are its request
    slot's selection (``keep`` row ``slot_of_row[row]``, its first
    ``keep_width`` blocks; later blocks and rows without a slot keep
    everything); else ``keep`` row ``row``. ``RECORD`` (the planner's step):
    it also writes the row's kept context length (before its query) and, for
    a row with a slot, records the step in the slot's counters and the totals
    (as ``RetrievalStats.record_rows``)."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCK_B)
    if RECORD:
        slot = tl.load(slot_of_row_ptr + row, mask=row < num_reqs, other=-1).to(tl.int64)
    if FROM_SLOTS:
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
    if RECORD:
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
