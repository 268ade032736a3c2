"""Block selection and the block-table rewrite as Triton kernels:
:func:`vllm_specextend.retrieval.kernels.selection.select_blocks` and
:func:`~vllm_specextend.retrieval.kernels.selection.rewrite_block_table` on CUDA.

The torch versions (``retrieval/kernels/selection.py``, the reference on CPU) take about
twenty small kernels and eight; these take one each. Selection finds each
row's top-k candidate chunks without a sort (a radix select over the score
bits, ties to the earlier chunk as the reference's stable sort gives them)
and marks their blocks; the rewrite moves a row's kept blocks to the front
in one pass (a count, then the ranks). The planner's decode step selects,
rewrites and records in one launch that reads and writes the request slots
directly (:func:`select_and_rewrite_decode_rows`); a step with windowed
prompt chunks rewrites and records in one (:func:`rewrite_rows_and_record`).
Launches only: no host sync. CPU tensors run under Triton's interpreter
(tests)."""

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
    if batch == 0 or num_blocks == 0:
        return keep
    _check_device(keep)
    score = chunk_score.float().contiguous()
    _kernels().select[(batch,)](
        score, retrieval_end_block, keep.view(torch.int8), score.stride(0), keep.stride(0),
        score.shape[1], num_blocks, top_k_chunks, sink_blocks, blocks_per_chunk,
        BY_POSITION=False, BLOCK_C=CHUNKS_PER_STEP, BLOCK_B=BLOCKS_PER_STEP, num_warps=4,
    )
    return keep


def rewrite_block_table_triton(
    block_table: torch.Tensor, keep: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rewrite_block_table`` on the kernel (arguments and result as there)."""
    compact, removed, _ = _rewrite(block_table, keep, None, None, None, None, block_size,
                                   None, None)
    return compact, removed


def select_and_rewrite_decode_rows(
    score_sums: torch.Tensor,
    selected: torch.Tensor,
    block_table: torch.Tensor,
    slot_of_row: torch.Tensor,
    due_of_row: torch.Tensor,
    num_blocks_selected: int,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    last_token_indices: torch.Tensor,
    block_size: int,
    recent_tokens: int,
    top_k_chunks: int,
    sink_blocks: int,
    blocks_per_chunk: int,
    per_slot: torch.Tensor,
    totals: torch.Tensor,
    by_position: bool = False,
    zero_scores: bool = False,
    window_query_start_loc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's plan after scoring, in one launch. Rows due
    (``due_of_row`` non-zero) select into their request slot's mask
    (``selected[slot_of_row[row], :num_blocks_selected]``) from the slot's
    ``score_sums`` (``by_position``: each chunk's index, as streaming ranks
    them), their recent window starting ``recent_tokens`` before the query
    (``window_query_start_loc``'s, the draft's first pass with a catch-up;
    None: ``query_start_loc``'s), rounded down to a block; ``zero_scores``
    then zeroes those scores.
    Every row's table is rewritten to its slot's mask (rows past
    ``slot_of_row`` or with slot -1 keep everything), and the tokens
    removed, the kept context lengths of the first ``len(slot_of_row)`` rows
    and the step, in the retrieval counters ``per_slot`` and ``totals``
    (``RetrievalStats.record_rows``), come out of the same launch. The
    planner's torch path (``select_blocks``, ``rewrite_block_table``,
    ``record_rows``: ~40 ops) is the reference."""
    batch, num_blocks = block_table.shape
    num_reqs = slot_of_row.shape[0]
    device = block_table.device
    compact = torch.empty_like(block_table)
    removed = torch.empty(batch, dtype=torch.int32, device=device)
    kept_lens = torch.empty(num_reqs, dtype=torch.int32, device=device)
    if batch == 0:
        return compact, removed, kept_lens
    _check_device(block_table)
    if window_query_start_loc is None:
        window_query_start_loc = query_start_loc
    _kernels().select_and_compact[(batch,)](
        score_sums, selected.view(torch.int8), block_table, compact, removed,
        slot_of_row, due_of_row, seq_lens, query_start_loc, window_query_start_loc,
        last_token_indices, kept_lens, per_slot, totals,
        score_sums.stride(0), selected.stride(0), block_table.stride(0), compact.stride(0),
        score_sums.shape[1], num_blocks, num_blocks_selected, top_k_chunks, sink_blocks,
        blocks_per_chunk, recent_tokens, block_size, num_reqs,
        BY_POSITION=by_position, ZERO_SCORES=zero_scores, BLOCK_C=CHUNKS_PER_STEP,
        BLOCK_B=BLOCKS_PER_STEP, num_warps=4,
    )
    return compact, removed, kept_lens


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
    """:func:`rewrite_block_table_triton` of a step whose kept blocks are
    given per batch row (``keep``: steps with windowed prompt chunks), with
    the kept context lengths and the record of
    :func:`select_and_rewrite_decode_rows`."""
    return _rewrite(block_table, keep, slot_of_row, seq_lens, query_start_loc,
                    last_token_indices, block_size, per_slot, totals)


def _rewrite(block_table, keep, slot_of_row, seq_lens, query_start_loc, last_token_indices,
             block_size, per_slot, totals):
    batch, num_blocks = block_table.shape
    record = slot_of_row is not None
    num_reqs = slot_of_row.shape[0] if record else 0
    compact = torch.empty_like(block_table)
    removed = torch.empty(batch, dtype=torch.int32, device=block_table.device)
    kept_lens = torch.empty(num_reqs, dtype=torch.int32, device=block_table.device)
    if batch == 0:
        return compact, removed, kept_lens
    _check_device(block_table)
    if not record:  # the record's pointers are not read
        slot_of_row = seq_lens = query_start_loc = last_token_indices = removed
        per_slot = totals = removed
    _kernels().compact[(batch,)](
        block_table, keep.view(torch.int8), compact, removed,
        slot_of_row, seq_lens, query_start_loc, last_token_indices, kept_lens, per_slot, totals,
        block_table.stride(0), keep.stride(0), compact.stride(0), num_blocks, block_size,
        num_reqs, RECORD=record, BLOCK_B=BLOCKS_PER_STEP, num_warps=4,
    )
    return compact, removed, kept_lens


def warm_up(selected: torch.Tensor, score_sums: torch.Tensor, per_slot: torch.Tensor,
            totals: torch.Tensor, by_position: bool, zero_scores: bool) -> None:
    """Compile the kernels before serving (a first compile takes seconds),
    for both paths of the planner with its options (``by_position``,
    ``zero_scores``: as :func:`select_and_rewrite_decode_rows` takes them),
    with the argument types it passes (int64 staged rows and slots, int32
    block tables, sequence lengths and query starts). Writes only what an
    empty step leaves as it was: no row is due, slot 0's selection keeps
    everything, and a zero step is recorded."""
    device = selected.device
    score = torch.zeros(1, 2, dtype=torch.float32, device=device)
    index = torch.zeros(1, dtype=torch.int64, device=device)
    zeros = torch.zeros(2, dtype=torch.int32, device=device)
    table = torch.zeros(1, 2, dtype=torch.int32, device=device)
    keep = select_blocks_triton(score, zeros[:1], 1, 0, 1, 2)
    rewrite_block_table_triton(table, keep, 16)
    select_and_rewrite_decode_rows(score_sums, selected, table, index, index, 2, zeros, zeros,
                                   zeros[:1], 16, 0, 0, 0, 1, per_slot, totals,
                                   by_position=by_position, zero_scores=zero_scores)
    rewrite_rows_and_record(table, keep, index, zeros, zeros, zeros[:1], 16, per_slot, totals)


def _check_device(tensor: torch.Tensor) -> None:
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton selection kernels run on CPU tensors only under "
                           "TRITON_INTERPRET=1, set before triton is imported")


class _Kernels:
    def __init__(self, select, compact, select_and_compact) -> None:
        self.select, self.compact = select, compact
        self.select_and_compact = select_and_compact


@functools.cache
def _kernels() -> _Kernels:
    """The kernels, jitted on first use (triton imported lazily)."""
    import triton

    from vllm_specextend.retrieval.kernels import _selection_triton_kernels as source

    return _Kernels(
        triton.jit(source.select_blocks_kernel, do_not_specialize=[
            "score_stride", "keep_stride", "num_chunks", "num_blocks",
            "top_k", "sink_blocks", "blocks_per_chunk"]),
        triton.jit(source.compact_block_table_kernel, do_not_specialize=[
            "table_stride", "keep_stride", "out_stride", "num_blocks", "block_size",
            "num_reqs"]),
        triton.jit(source.select_and_compact_kernel, do_not_specialize=[
            "score_stride", "selected_stride", "table_stride", "out_stride", "num_chunks",
            "num_blocks", "keep_width", "top_k", "sink_blocks", "blocks_per_chunk",
            "recent_tokens", "block_size", "num_reqs"]),
    )
