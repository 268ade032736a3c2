"""Cross-model Retrieval as pure tensor functions.

Nothing here knows vLLM: every function takes tensors and returns tensors, so
each can be checked against a dense reference without an engine. The batched
forms avoid host syncs (no ``.item()``/``.tolist()``), so they run unchanged
inside the GPU drafting loop.
"""

from __future__ import annotations

import torch


def context_keys(
    key_buffer: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    block_size: int,
) -> torch.Tensor:
    """Gather each request's keys, in position order, from a slot-indexed buffer.

    Args:
        key_buffer: ``[num_slots, num_kv_heads, head_dim]``, slot = block * block_size + offset.
        block_table: ``[batch, max_blocks]`` block ids of each request.
        max_context_len: positions to gather (the longest context in the batch).
    Returns:
        ``[batch, max_context_len, num_kv_heads, head_dim]``; rows past a request's
        context hold whatever its block table points to and must be masked.
    """
    positions = torch.arange(max_context_len, device=block_table.device)
    blocks = block_table[:, positions // block_size].long()
    slots = blocks * block_size + positions % block_size
    return key_buffer[slots.clamp_(0, key_buffer.shape[0] - 1)]


def attention_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of each query row over its causal context, summed over heads.

    Args:
        queries: ``[batch, rows, num_heads, head_dim]`` post-RoPE queries.
        keys: ``[batch, context, num_kv_heads, head_dim]`` post-RoPE keys.
        query_positions: ``[batch, rows]`` position of each query row; a row
            attends to keys at positions ``<= query_position``. Rows with a
            negative position are padding and get zero scores.
        scale: softmax scale (1/sqrt(head_dim) for most models).
    Returns:
        ``[batch, rows, context]``, the attention probabilities summed over the
        query heads (divide by the number of heads for the mean; the sum lets
        tensor-parallel ranks all-reduce their partial head sums).
    """
    batch, rows, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    # GQA: query head h reads kv head h // group.
    q = queries.float().view(batch, rows, num_kv_heads, group, head_dim)
    k = keys.float()
    logits = torch.einsum("brkgd,bckd->brkgc", q, k) * scale
    context = keys.shape[1]
    positions = torch.arange(context, device=keys.device)
    visible = positions.view(1, 1, context) <= query_positions.unsqueeze(-1)
    logits = logits.masked_fill(~visible.view(batch, rows, 1, 1, context), -torch.inf)
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    return probs.sum(dim=(2, 3))


def chunk_scores(
    token_scores: torch.Tensor, context_lens: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Mean score of the tokens of each fixed-size chunk.

    Args:
        token_scores: ``[batch, context]`` scores per position.
        context_lens: ``[batch]`` valid positions per request.
    Returns:
        ``[batch, ceil(context / chunk_size)]``; chunks with no valid token are 0.
    """
    batch, context = token_scores.shape
    num_chunks = -(-context // chunk_size)
    pad = num_chunks * chunk_size - context
    positions = torch.arange(num_chunks * chunk_size, device=token_scores.device)
    valid = positions.view(1, -1) < context_lens.view(-1, 1)
    scores = torch.nn.functional.pad(token_scores, (0, pad)) * valid
    sums = scores.view(batch, num_chunks, chunk_size).sum(-1)
    counts = valid.view(batch, num_chunks, chunk_size).sum(-1)
    return sums / counts.clamp(min=1)


def select_blocks(
    chunk_score: torch.Tensor,
    retrieval_end_block: torch.Tensor,
    top_k_chunks: int,
    sink_blocks: int,
    blocks_per_chunk: int,
    num_blocks: int,
) -> torch.Tensor:
    """Blocks the draft keeps: sink, top-k scored chunks, and everything after.

    Args:
        chunk_score: ``[batch, num_chunks]`` higher is kept first; ties go to the
            earlier chunk. Use ``-inf`` for chunks that must not be picked.
        retrieval_end_block: ``[batch]`` first block of the recent window; only
            whole chunks that end at or before it compete in the top-k, and all
            blocks from it on are kept.
        top_k_chunks: chunks to keep besides the sink and the recent window.
        sink_blocks: leading blocks always kept.
        blocks_per_chunk: KV blocks per chunk.
        num_blocks: width of the block table.
    Returns:
        ``[batch, num_blocks]`` bool mask of kept blocks.
    """
    batch, num_chunks = chunk_score.shape
    device = chunk_score.device
    block_ids = torch.arange(num_blocks, device=device)
    keep = (block_ids.view(1, -1) < sink_blocks) | (
        block_ids.view(1, -1) >= retrieval_end_block.view(-1, 1)
    )
    if top_k_chunks > 0 and num_chunks > 0:
        chunk_end_block = (torch.arange(num_chunks, device=device) + 1) * blocks_per_chunk
        chunk_start_block = chunk_end_block - blocks_per_chunk
        candidate = (chunk_end_block.view(1, -1) <= retrieval_end_block.view(-1, 1)) & (
            chunk_start_block.view(1, -1) >= sink_blocks
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
    block_table: torch.Tensor, keep: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact each row of a block table to its kept blocks, in original order.

    Removed blocks must all lie before the blocks holding the query, so that
    positions after them shift uniformly and the causal diagonal and in-block
    offsets stay right.

    Returns:
        ``(compact_table, removed_tokens)``: the rewritten ``[batch, max_blocks]``
        table (kept blocks first, the rest as in the original order) and
        ``[batch]`` tokens removed, to subtract from ``seq_lens``.
    """
    # argsort of "not kept" with a stable sort moves kept blocks to the front
    # in their original order, without a host sync.
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    compact = torch.gather(block_table, 1, order.to(torch.int64))
    removed = (~keep).sum(dim=1) * block_size
    return compact, removed.to(torch.int32)
