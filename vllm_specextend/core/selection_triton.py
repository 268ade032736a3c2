"""Block selection and the block-table rewrite as Triton kernels:
:func:`vllm_specextend.core.selection.select_blocks` and
:func:`~vllm_specextend.core.selection.rewrite_block_table` on CUDA.

The torch versions (``core/selection.py``, the reference on CPU) take about
twenty small kernels and eight; these take one each. Selection finds each
row's top-k candidate chunks without a sort (a radix select over the score
bits, ties to the earlier chunk as the reference's stable sort gives them)
and marks their blocks; the rewrite moves a row's kept blocks to the front
in one pass (a count, then the ranks). The planner's decode steps use the
variants that read and write request slots directly and fold the record in
(:func:`select_blocks_into_slots`, :func:`rewrite_decode_rows`,
:func:`rewrite_rows_and_record`). Launches
only: no host sync. CPU tensors run under Triton's interpreter (tests)."""

from __future__ import annotations

import functools
import os

import torch

CHUNKS_PER_STEP = 1024
"""Chunks of a row the selection kernel reads per loop step."""
BLOCKS_PER_STEP = 1024
"""Block-table entries per loop step of both kernels."""


def select_blocks_triton(
    chunk_score: torch.Tensor,
    retrieval_end_block: torch.Tensor,
    top_k_chunks: int,
    sink_blocks: int,
    blocks_per_chunk: int,
    num_blocks: int,
) -> torch.Tensor:
    """``select_blocks`` on the kernel (arguments and result as there)."""
    batch = chunk_score.shape[0]
    keep = torch.empty(batch, num_blocks, dtype=torch.bool, device=chunk_score.device)
    _select(chunk_score.float().contiguous(), keep, top_k_chunks, sink_blocks,
            blocks_per_chunk, num_blocks, num_rows=batch, recent=retrieval_end_block)
    return keep


def select_blocks_into_slots(
    score_sums: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    selected: torch.Tensor,
    recent_tokens: int,
    block_size: int,
    top_k_chunks: int,
    sink_blocks: int,
    blocks_per_chunk: int,
    num_blocks: int,
    by_position: bool = False,
) -> None:
    """``select_blocks`` for batch ``rows`` of requests in ``slots``: the
    scores of slot ``s`` are ``score_sums[s]`` (``by_position``: each chunk's
    index, as streaming ranks them), each row's recent window starts
    ``recent_tokens`` before its query (rounded down to a block), and the
    mask is written to ``selected[s, :num_blocks]``. One launch for the
    planner's ~10 ops around the selection."""
    _select(score_sums, selected, top_k_chunks, sink_blocks, blocks_per_chunk, num_blocks,
            num_rows=rows.shape[0], batch_rows=(rows, slots, seq_lens, query_start_loc),
            recent_tokens=recent_tokens, block_size=block_size, by_position=by_position)


def _select(score, keep, top_k_chunks, sink_blocks, blocks_per_chunk, num_blocks, *,
            num_rows, recent=None, batch_rows=None, recent_tokens=0, block_size=1,
            by_position=False) -> None:
    if num_rows == 0 or num_blocks == 0:
        return
    _check_device(keep)
    rows, keep_rows, seq_lens, starts = batch_rows or (keep, keep, keep, keep)
    _kernels().select[(num_rows,)](
        score, keep if recent is None else recent, keep.view(torch.int8),
        rows, keep_rows, seq_lens, starts, score.stride(0), keep.stride(0),
        score.shape[1], num_blocks, top_k_chunks, sink_blocks, blocks_per_chunk, recent_tokens,
        block_size, FROM_BATCH=batch_rows is not None, BY_POSITION=by_position,
        BLOCK_C=CHUNKS_PER_STEP, BLOCK_B=BLOCKS_PER_STEP, num_warps=4,
    )


def rewrite_block_table_triton(
    block_table: torch.Tensor, keep: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rewrite_block_table`` on the kernel (arguments and result as there)."""
    batch, num_blocks = block_table.shape
    compact = torch.empty_like(block_table)
    removed = torch.empty(batch, dtype=torch.int32, device=block_table.device)
    if batch == 0:
        return compact, removed
    _check_device(block_table)
    _kernels().compact[(batch,)](
        block_table, keep.view(torch.int8), compact, removed,
        removed, removed, removed, removed, removed, removed, removed,
        block_table.stride(0), keep.stride(0), compact.stride(0), num_blocks, block_size,
        0, num_blocks, FROM_SLOTS=False, RECORD=False, BLOCK_B=BLOCKS_PER_STEP, num_warps=4,
    )
    return compact, removed


def rewrite_decode_rows(
    block_table: torch.Tensor,
    selected: torch.Tensor,
    slot_of_row: torch.Tensor,
    num_blocks_selected: int,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    last_token_indices: torch.Tensor,
    block_size: int,
    per_slot: torch.Tensor,
    totals: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's plan after selection, in one launch: each row's table
    rewritten to its request slot's selection (``selected[slot_of_row[row],
    :num_blocks_selected]``; rows past ``slot_of_row`` or with slot -1 keep
    everything), the tokens removed, the kept context lengths of the first
    ``len(slot_of_row)`` rows, and the step recorded in the retrieval
    counters ``per_slot`` and ``totals`` (``RetrievalStats.record_rows``).
    The planner's torch path does this in ~20 ops; it is the reference."""
    return _rewrite_and_record(block_table, selected, slot_of_row, num_blocks_selected,
                               seq_lens, query_start_loc, last_token_indices, block_size,
                               per_slot, totals, from_slots=True)


def rewrite_rows_and_record(
    block_table: torch.Tensor,
    keep: torch.Tensor,
    slot_of_row: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    last_token_indices: torch.Tensor,
    block_size: int,
    per_slot: torch.Tensor,
    totals: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rewrite_decode_rows` for a step whose kept blocks are given per
    batch row (``keep``, as :func:`rewrite_block_table_triton` takes them):
    steps with windowed prompt chunks."""
    return _rewrite_and_record(block_table, keep, slot_of_row, keep.shape[1], seq_lens,
                               query_start_loc, last_token_indices, block_size, per_slot,
                               totals, from_slots=False)


def _rewrite_and_record(block_table, keep, slot_of_row, keep_width, seq_lens, query_start_loc,
                        last_token_indices, block_size, per_slot, totals, *, from_slots):
    batch, num_blocks = block_table.shape
    num_reqs = slot_of_row.shape[0]
    compact = torch.empty_like(block_table)
    removed = torch.empty(batch, dtype=torch.int32, device=block_table.device)
    kept_lens = torch.empty(num_reqs, dtype=torch.int32, device=block_table.device)
    if batch == 0:
        return compact, removed, kept_lens
    _check_device(block_table)
    _kernels().compact[(batch,)](
        block_table, keep.view(torch.int8), compact, removed,
        slot_of_row, seq_lens, query_start_loc, last_token_indices, kept_lens, per_slot, totals,
        block_table.stride(0), keep.stride(0), compact.stride(0), num_blocks, block_size,
        num_reqs, keep_width, FROM_SLOTS=from_slots, RECORD=True, BLOCK_B=BLOCKS_PER_STEP,
        num_warps=4,
    )
    return compact, removed, kept_lens


def warm_up(selected: torch.Tensor, per_slot: torch.Tensor, totals: torch.Tensor) -> None:
    """Compile the kernels before serving (a first compile takes seconds),
    for both paths of the planner, with the argument types it passes (int64
    staged rows and slots, int32 block tables, sequence lengths and query
    starts). Writes only what an empty step leaves as it was: slot 0's
    selection keeps everything and records a zero step."""
    device = selected.device
    score = torch.zeros(1, 2, dtype=torch.float32, device=device)
    index = torch.zeros(1, dtype=torch.int64, device=device)
    zeros = torch.zeros(2, dtype=torch.int32, device=device)
    table = torch.zeros(1, 2, dtype=torch.int32, device=device)
    keep = select_blocks_triton(score, zeros[:1], 1, 0, 1, 2)
    rewrite_block_table_triton(table, keep, 16)
    for by_position in (False, True):
        select_blocks_into_slots(score, index, index, zeros, zeros, selected, 0, 16, 0, 0, 1, 2,
                                 by_position=by_position)
    rewrite_decode_rows(table, selected, index, 2, zeros, zeros, zeros[:1], 16, per_slot, totals)
    rewrite_rows_and_record(table, keep, index, zeros, zeros, zeros[:1], 16, per_slot, totals)


def _check_device(tensor: torch.Tensor) -> None:
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton selection kernels run on CPU tensors only under "
                           "TRITON_INTERPRET=1, set before triton is imported")


class _Kernels:
    def __init__(self, select, compact) -> None:
        self.select, self.compact = select, compact


@functools.cache
def _kernels() -> _Kernels:
    """Both kernels, jitted on first use (triton imported lazily)."""
    import triton

    from vllm_specextend.core import _selection_triton_kernels as source

    return _Kernels(
        triton.jit(source.select_blocks_kernel, do_not_specialize=[
            "score_stride", "keep_stride", "num_chunks", "num_blocks",
            "top_k", "sink_blocks", "blocks_per_chunk", "recent_tokens", "block_size"]),
        triton.jit(source.compact_block_table_kernel, do_not_specialize=[
            "table_stride", "keep_stride", "out_stride", "num_blocks", "block_size",
            "num_reqs", "keep_width"]),
    )
