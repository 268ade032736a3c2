"""Triton kernels of ``retrieval/kernels/selection_triton.py`` (see its docstring), as
plain functions: ``selection_triton._kernels`` jits them on first use, for
the GPU or for Triton's interpreter (this module is imported then, so its
helpers are jitted after TRITON_INTERPRET is read). One program per row.
``_select_row`` runs to 50 lines: one program's radix select over a row
reads best in one piece."""

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


@triton.jit
def _select_row(score_row, keep_row, recent, num_chunks, num_blocks, top_k, sink_blocks,
                blocks_per_chunk, BY_POSITION: tl.constexpr, BLOCK_C: tl.constexpr,
                BLOCK_B: tl.constexpr):
    """A row's kept blocks (see :func:`select_blocks_kernel`), its mask
    written to ``keep_row``.

    The top-k without a sort: a radix select finds the k-th best key bit by
    bit (32 counting passes over the row's scores), then the chunks above it
    and the earliest of those equal to it are picked."""
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


@triton.jit
def _recent_start_block(row, seq_lens_ptr, start_ptr, recent_tokens, block_size):
    """Batch row ``row``'s recent window's first block: ``recent_tokens``
    before its query (starts ``start_ptr``), rounded down to a block."""
    query_len = tl.load(start_ptr + row + 1) - tl.load(start_ptr + row)
    first_query_pos = tl.load(seq_lens_ptr + row) - query_len
    return (tl.maximum(first_query_pos - recent_tokens, 0) // block_size).to(tl.int32)


def select_blocks_kernel(
    score_ptr, recent_ptr, keep_ptr, score_stride, keep_stride,
    num_chunks, num_blocks, top_k, sink_blocks, blocks_per_chunk,
    BY_POSITION: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Row ``i``'s kept blocks: the sink, everything from the recent
    window's first block ``recent[i]``, and the blocks of its ``top_k`` best
    candidate chunks (whole chunks between the sink and the recent window,
    with a finite score; ties go to the earlier chunk)."""
    i = tl.program_id(0).to(tl.int64)
    _select_row(score_ptr + i * score_stride, keep_ptr + i * keep_stride,
                tl.load(recent_ptr + i).to(tl.int32), num_chunks, num_blocks, top_k, sink_blocks,
                blocks_per_chunk, BY_POSITION, BLOCK_C, BLOCK_B)


@triton.jit
def _compact_row(table_row, keep_row, out_row, keep_limit, num_blocks, BLOCK_B: tl.constexpr):
    """A row's table with its kept blocks first and the rest after them,
    each in their original order (blocks from ``keep_limit`` on are kept);
    returns the blocks kept."""
    b = tl.arange(0, BLOCK_B)
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
        value = tl.load(table_row + block, mask=in_row, other=0)
        tl.store(out_row + dest, value, mask=in_row)
        kept_before += tl.sum(keep.to(tl.int32), 0)
        removed_before += tl.sum(gone.to(tl.int32), 0)
    return num_kept


@triton.jit
def _record_row(row, slot, removed, seq_lens_ptr, start_ptr, last_ptr, kept_lens_ptr,
                per_slot_ptr, totals_ptr):
    """A row's kept context length (before its query) and, for a row with a
    slot, the step recorded in the slot's counters and the totals (as
    ``RetrievalStats.record_rows``)."""
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


def compact_block_table_kernel(
    table_ptr, keep_ptr, out_ptr, removed_ptr,
    slot_of_row_ptr, seq_lens_ptr, start_ptr, last_ptr, kept_lens_ptr, per_slot_ptr, totals_ptr,
    table_stride, keep_stride, out_stride, num_blocks, block_size, num_reqs,
    RECORD: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """A row's table with its kept blocks (``keep`` row ``row``) first and
    the rest after them, each in their original order, and the tokens
    removed. ``RECORD`` (the planner's step): it also writes the row's kept
    context length and records the step for a row with a slot
    (``slot_of_row``; :func:`_record_row`)."""
    row = tl.program_id(0).to(tl.int64)
    num_kept = _compact_row(table_ptr + row * table_stride, keep_ptr + row * keep_stride,
                            out_ptr + row * out_stride, num_blocks, num_blocks, BLOCK_B)
    removed = (num_blocks - num_kept) * block_size
    tl.store(removed_ptr + row, removed)
    if RECORD:
        if row < num_reqs:
            slot = tl.load(slot_of_row_ptr + row).to(tl.int64)
            _record_row(row, slot, removed, seq_lens_ptr, start_ptr, last_ptr, kept_lens_ptr,
                        per_slot_ptr, totals_ptr)


def select_and_compact_kernel(
    score_ptr, selected_ptr, table_ptr, out_ptr, removed_ptr,
    slot_of_row_ptr, due_of_row_ptr, seq_lens_ptr, start_ptr, window_start_ptr, last_ptr,
    kept_lens_ptr, per_slot_ptr, totals_ptr,
    score_stride, selected_stride, table_stride, out_stride,
    num_chunks, num_blocks, keep_width, top_k, sink_blocks, blocks_per_chunk, recent_tokens,
    block_size, num_reqs,
    BY_POSITION: tl.constexpr, ZERO_SCORES: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """A decode step's selection, rewrite and record in one program per
    batch row: a row due (``due_of_row``) selects into its slot's mask
    (:func:`_select_row` over the first ``keep_width`` blocks, its recent
    window ``recent_tokens`` before its query as the draft's first pass runs
    it: ``window_start_ptr``'s query starts; ``ZERO_SCORES`` then zeroes the
    slot's scores),
    then every row's table is rewritten from its slot's mask and the step
    recorded (:func:`compact_block_table_kernel` with ``FROM_SLOTS`` and
    ``RECORD``). A slot is one row's, so no program reads another's mask."""
    row = tl.program_id(0).to(tl.int64)
    in_batch = row < num_reqs
    slot = tl.load(slot_of_row_ptr + row, mask=in_batch, other=-1).to(tl.int64)
    due = tl.load(due_of_row_ptr + row, mask=in_batch, other=0)
    keep_row = selected_ptr + tl.maximum(slot, 0) * selected_stride
    if due != 0:
        score_row = score_ptr + slot * score_stride
        recent = _recent_start_block(row, seq_lens_ptr, window_start_ptr, recent_tokens,
                                     block_size)
        _select_row(score_row, keep_row, recent, num_chunks, keep_width, top_k, sink_blocks,
                    blocks_per_chunk, BY_POSITION, BLOCK_C, BLOCK_B)
        tl.debug_barrier()  # the mask and the scores are read by other threads
        if ZERO_SCORES:
            c = tl.arange(0, BLOCK_C)
            for start in range(0, num_chunks, BLOCK_C):
                tl.store(score_row + start + c, tl.zeros((BLOCK_C,), tl.float32),
                         mask=start + c < num_chunks)
    keep_limit = tl.where(slot >= 0, keep_width, 0)
    num_kept = _compact_row(table_ptr + row * table_stride, keep_row, out_ptr + row * out_stride,
                            keep_limit, num_blocks, BLOCK_B)
    removed = (num_blocks - num_kept) * block_size
    tl.store(removed_ptr + row, removed)
    if in_batch:
        _record_row(row, slot, removed, seq_lens_ptr, start_ptr, last_ptr, kept_lens_ptr,
                    per_slot_ptr, totals_ptr)
