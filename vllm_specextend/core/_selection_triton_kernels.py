"""Triton kernels of ``core/selection_triton.py`` (see its docstring), as
plain functions: ``selection_triton._kernels`` jits them on first use, for
the GPU or for Triton's interpreter. One program per row."""

import triton.language as tl


def select_blocks_kernel(
    score_ptr, order_ptr, recent_ptr, keep_ptr,
    score_stride, order_stride, keep_stride,
    num_chunks, num_blocks, top_k, sink_blocks, blocks_per_chunk,
    BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """A row's kept blocks: the sink, everything from the recent window's
    first block, and the blocks of the first ``top_k`` candidate chunks (whole
    chunks between the sink and the recent window, with a finite score) in
    ``order`` (the row's chunks by descending score, stable)."""
    row = tl.program_id(0).to(tl.int64)
    recent = tl.load(recent_ptr + row).to(tl.int32)
    keep_row = keep_ptr + row * keep_stride
    b = tl.arange(0, BLOCK_B)
    for start in range(0, num_blocks, BLOCK_B):
        block = start + b
        tl.store(keep_row + block, ((block < sink_blocks) | (block >= recent)).to(tl.int8),
                 mask=block < num_blocks)
    # The picks below write blocks this row's first loop wrote: order them.
    tl.debug_barrier()
    i = tl.arange(0, BLOCK_C)
    picked = tl.zeros((), tl.int32)
    start = 0
    while (start < num_chunks) & (picked < top_k):
        rank = start + i
        in_row = rank < num_chunks
        chunk = tl.load(order_ptr + row * order_stride + rank, mask=in_row, other=0).to(tl.int32)
        score = tl.load(score_ptr + row * score_stride + chunk, mask=in_row, other=0.0)
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
    table_stride, keep_stride, out_stride,
    num_blocks, block_size,
    BLOCK_B: tl.constexpr,
):
    """A row's table with its kept blocks first and the rest after them,
    each in their original order, and the tokens removed."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCK_B)
    num_kept = tl.zeros((), tl.int32)
    for start in range(0, num_blocks, BLOCK_B):
        block = start + b
        keep = tl.load(keep_ptr + row * keep_stride + block, mask=block < num_blocks, other=0)
        num_kept += tl.sum((keep != 0).to(tl.int32), 0)
    kept_before = tl.zeros((), tl.int32)
    removed_before = tl.zeros((), tl.int32)
    for start in range(0, num_blocks, BLOCK_B):
        block = start + b
        in_row = block < num_blocks
        keep = tl.load(keep_ptr + row * keep_stride + block, mask=in_row, other=0) != 0
        gone = in_row & ~keep
        kept_rank = tl.cumsum(keep.to(tl.int32), 0)
        gone_rank = tl.cumsum(gone.to(tl.int32), 0)
        dest = tl.where(keep, kept_before + kept_rank - 1, num_kept + removed_before + gone_rank - 1)
        value = tl.load(table_ptr + row * table_stride + block, mask=in_row, other=0)
        tl.store(out_ptr + row * out_stride + dest, value, mask=in_row)
        kept_before += tl.sum(keep.to(tl.int32), 0)
        removed_before += tl.sum(gone.to(tl.int32), 0)
    tl.store(removed_ptr + row, (num_blocks - num_kept) * block_size)
