"""Dense references the tests check the bounded production code against:
the whole context gathered, softmax in float32, chunk means. Test-only: the
planner scores tile by tile (``vllm_specextend.retrieval.kernels.scoring``)."""

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
