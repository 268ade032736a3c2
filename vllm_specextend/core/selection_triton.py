"""Block selection and the block-table rewrite as Triton kernels:
:func:`vllm_specextend.core.selection.select_blocks` and
:func:`~vllm_specextend.core.selection.rewrite_block_table` on CUDA.

The torch versions (``core/selection.py``, the reference on CPU) take about
twenty small kernels and eight; these take a sort and one kernel, and one
kernel. Selection walks each row's chunks by descending score (``torch.sort``,
stable, so ties go to the earlier chunk) and marks the blocks of the first
``top_k`` candidates; the rewrite moves a row's kept blocks to the front in
one pass (a count, then the ranks). Launches only: no host sync. CPU tensors
run under Triton's interpreter (tests)."""

from __future__ import annotations

import functools
import os

import torch

CHUNKS_PER_STEP = 256
"""Chunks of a row's order looked at per loop step of the selection kernel."""
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
    batch, num_chunks = chunk_score.shape
    keep = torch.empty(batch, num_blocks, dtype=torch.bool, device=chunk_score.device)
    if batch == 0 or num_blocks == 0:
        return keep
    _check_device(chunk_score)
    score = chunk_score.float().contiguous()
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    _kernels().select[(batch,)](
        score, order, retrieval_end_block, keep.view(torch.int8),
        score.stride(0), order.stride(0), keep.stride(0),
        num_chunks, num_blocks, top_k_chunks, sink_blocks, blocks_per_chunk,
        BLOCK_C=CHUNKS_PER_STEP, BLOCK_B=BLOCKS_PER_STEP, num_warps=4,
    )
    return keep


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
        block_table.stride(0), keep.stride(0), compact.stride(0), num_blocks, block_size,
        BLOCK_B=BLOCKS_PER_STEP, num_warps=4,
    )
    return compact, removed


def warm_up(device: torch.device, table_dtype: torch.dtype = torch.int32) -> None:
    """Compile both kernels before serving (a first compile takes seconds),
    with the argument types the planner passes."""
    score = torch.zeros(1, 2, dtype=torch.float32, device=device)
    recent = torch.ones(1, dtype=torch.int32, device=device)
    keep = select_blocks_triton(score, recent, 1, 0, 1, 2)
    rewrite_block_table_triton(torch.zeros(1, 2, dtype=table_dtype, device=device), keep, 16)


def _check_device(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
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
            "score_stride", "order_stride", "keep_stride", "num_chunks", "num_blocks",
            "top_k", "sink_blocks", "blocks_per_chunk"]),
        triton.jit(source.compact_block_table_kernel, do_not_specialize=[
            "table_stride", "keep_stride", "out_stride", "num_blocks", "block_size"]),
    )
