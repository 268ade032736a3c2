"""Which KV blocks the draft keeps, and its block table rewritten to them.

Pure tensor functions without host syncs (no ``.item()``/``.tolist()``), so
they run unchanged inside the GPU drafting loop.
"""

from __future__ import annotations

import torch


def select_blocks(
    chunk_score: torch.Tensor,
    retrieval_end_block: torch.Tensor,
    top_k_chunks: int,
    sink_blocks: int,
    blocks_per_chunk: int,
    num_blocks: int,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """Blocks the draft keeps: sink, top-k scored chunks, and everything after.

    Args:
        chunk_score: ``[batch, num_chunks]`` higher is kept first; ties go to the
            earlier chunk. Chunks scored ``-inf`` are never picked.
        retrieval_end_block: ``[batch]`` first block of the recent window; only
            whole chunks that end at or before it compete in the top-k, and all
            blocks from it on are kept.
        top_k_chunks: chunks to keep besides the sink and the recent window.
        sink_blocks: leading blocks always kept.
        blocks_per_chunk: KV blocks per chunk.
        num_blocks: width of the block table.
        use_kernel: run the Triton kernel (``retrieval/kernels/selection_triton.py``)
            rather than these torch ops (default: on CUDA).
    Returns:
        ``[batch, num_blocks]`` bool mask of kept blocks.
    """
    if _use_kernel(use_kernel, chunk_score):
        from vllm_specextend.retrieval.kernels.selection_triton import select_blocks_triton

        return select_blocks_triton(chunk_score, retrieval_end_block, top_k_chunks,
                                    sink_blocks, blocks_per_chunk, num_blocks)
    batch, num_chunks = chunk_score.shape
    device = chunk_score.device
    block_ids = torch.arange(num_blocks, device=device)
    keep = (block_ids.view(1, -1) < sink_blocks) | (
        block_ids.view(1, -1) >= retrieval_end_block.view(-1, 1)
    )
    if top_k_chunks > 0 and num_chunks > 0:
        chunk_end_block = (torch.arange(num_chunks, device=device) + 1) * blocks_per_chunk
        chunk_start_block = chunk_end_block - blocks_per_chunk
        candidate = (
            (chunk_end_block.view(1, -1) <= retrieval_end_block.view(-1, 1))
            & (chunk_start_block.view(1, -1) >= sink_blocks)
            & (chunk_score > -torch.inf)
        )
        score = torch.where(candidate, chunk_score.float(), -torch.inf)
        # Stable descending sort: equal scores keep chunk order, so ties pick
        # the earlier chunk deterministically on every rank.
        order = torch.sort(score, dim=1, descending=True, stable=True).indices
        k = min(top_k_chunks, num_chunks)
        top = order[:, :k]
        picked = torch.zeros_like(candidate)
        picked.scatter_(1, top, torch.ones_like(top, dtype=torch.bool))
        picked &= candidate
        picked_blocks = picked.repeat_interleave(blocks_per_chunk, dim=1)
        width = min(num_blocks, picked_blocks.shape[1])
        keep[:, :width] |= picked_blocks[:, :width]
    return keep


def rewrite_block_table(
    block_table: torch.Tensor, keep: torch.Tensor, block_size: int,
    use_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact each row of a block table to its kept blocks, in original order.

    Removed blocks must all lie before the blocks holding the query, so that
    positions after them shift uniformly and the causal diagonal and in-block
    offsets stay right.

    Returns:
        ``(compact_table, removed_tokens)``: the rewritten ``[batch, max_blocks]``
        table (kept blocks first, the rest as in the original order) and
        ``[batch]`` tokens removed, to subtract from ``seq_lens``.
        ``use_kernel`` as in :func:`select_blocks`.
    """
    if _use_kernel(use_kernel, block_table):
        from vllm_specextend.retrieval.kernels.selection_triton import rewrite_block_table_triton

        return rewrite_block_table_triton(block_table, keep, block_size)
    # argsort of "not kept" with a stable sort moves kept blocks to the front
    # in their original order, without a host sync.
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    compact = torch.gather(block_table, 1, order.to(torch.int64))
    removed = (~keep).sum(dim=1) * block_size
    return compact, removed.to(torch.int32)


def _use_kernel(use_kernel: bool | None, tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" if use_kernel is None else use_kernel
