"""Chunk scores from the target's last-layer attention, in a fixed workspace.

The score of a chunk is the softmax attention its tokens receive from the
target's query rows, summed over heads (``tests/dense_reference.py`` holds
the dense reference). Here the context is read tile by tile from the tap's
slot-indexed key buffer, in the model dtype, with a two-pass softmax: the
first pass finds each head's log-sum-exp, the second sums the probabilities
per chunk. Every buffer of a tile lives in a :class:`ScoringWorkspace`
allocated once, so scoring memory does not grow with batch x context. When
the context fits one tile, the second pass reuses the first one's tile.

On CUDA the same sums come from a Triton kernel that reads each key once
(``retrieval/kernels/scoring_triton.py``); the torch path here is the CPU path and the
reference the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_specextend.retrieval.kernels.scoring_work import max_work_items

SCORING_TILE_TOKENS = 32768
"""Context positions x batch rows scored per tile (the workspace's size)."""
KERNEL_PARTIALS_BYTES = 64 << 20
"""The kernel's granule sums at most (a batch beyond them is scored in row
groups): 64 x 32K tokens of an 8B-class layer (5 query rows, 32 heads, chunk
32) fit at once."""
SMALLEST_GRANULE = 16
"""Granule the kernel's partials are sized for (chunks of 16 tokens)."""

_NO_LOGIT = -1e30  # finite "minus infinity" for the running maximum


@dataclass
class ScoringWorkspace:
    """Flat buffers for one scoring tile, allocated before vLLM measures free
    memory; each tile views the leading part it needs. With ``use_kernel``
    (the default on CUDA) the torch path's buffers are empty and the Triton
    kernel's partials are allocated instead."""

    tile_tokens: int
    keys: torch.Tensor
    """Model dtype: ``[rows x positions, num_kv_heads, head_dim]`` of a tile."""
    queries: torch.Tensor
    """Model dtype: the queries of a row group, grouped by KV head."""
    logits_model_dtype: torch.Tensor
    logits: torch.Tensor
    """Float32: ``[kv head, row, query row, group, position]`` of a tile."""
    block_ids: torch.Tensor
    slots: torch.Tensor
    use_kernel: bool = False
    granule_logsumexp: torch.Tensor | None = None
    """Float32, the kernel's per-granule log-sum-exps:
    ``[rows, query rows, heads, granules]`` of a row group."""
    split_logsumexp: torch.Tensor | None = None
    """Float32, the kernel's sums per work item: ``[items, query rows x heads]``
    (``retrieval/kernels/scoring_work.py`` bounds the items)."""
    layer: tuple[int, int, int, int] | None = None
    """The kernel's (num_heads, num_kv_heads, head_dim, max_query_rows)."""

    @classmethod
    def allocate(
        cls,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_num_reqs: int,
        max_query_rows: int,
        dtype: torch.dtype,
        device: torch.device,
        tile_tokens: int = SCORING_TILE_TOKENS,
        use_kernel: bool | None = None,
        max_context_len: int | None = None,
    ) -> ScoringWorkspace:
        """``use_kernel``: score with the Triton kernel (default: on CUDA).
        ``max_context_len``: the longest context scored (the model's
        length); sizes the kernel's partials to what the batch needs, capped
        at :data:`KERNEL_PARTIALS_BYTES` but always at least one row."""
        if use_kernel is None:
            use_kernel = device.type == "cuda"
        if use_kernel:
            return cls._allocate_kernel(num_heads, num_kv_heads, head_dim, max_num_reqs,
                                        max_query_rows, dtype, device, max_context_len)
        logit_count = tile_tokens * max_query_rows * num_heads
        return cls(
            tile_tokens=tile_tokens,
            keys=torch.empty(num_kv_heads * tile_tokens * head_dim, dtype=dtype, device=device),
            queries=torch.empty(
                max_num_reqs * max_query_rows * num_heads * head_dim, dtype=dtype, device=device
            ),
            logits_model_dtype=torch.empty(logit_count, dtype=dtype, device=device),
            logits=torch.empty(logit_count, dtype=torch.float32, device=device),
            block_ids=torch.empty(tile_tokens, dtype=torch.int32, device=device),
            slots=torch.empty(tile_tokens, dtype=torch.int64, device=device),
        )

    @classmethod
    def _allocate_kernel(cls, num_heads, num_kv_heads, head_dim, max_num_reqs, max_query_rows,
                         dtype, device, max_context_len) -> ScoringWorkspace:
        row_floats = max_query_rows * num_heads
        budget = KERNEL_PARTIALS_BYTES // 4
        if max_context_len is not None:
            one_row = row_floats * -(-max_context_len // SMALLEST_GRANULE)
            budget = max(one_row, min(budget, max_num_reqs * one_row))
        empty = torch.empty(0, dtype=dtype, device=device)
        return cls(
            tile_tokens=0, keys=empty, queries=empty, logits_model_dtype=empty,
            logits=torch.empty(0, dtype=torch.float32, device=device),
            block_ids=torch.empty(0, dtype=torch.int32, device=device),
            slots=torch.empty(0, dtype=torch.int64, device=device),
            use_kernel=True,
            granule_logsumexp=torch.empty(budget, dtype=torch.float32, device=device),
            split_logsumexp=torch.empty(max_work_items(max_num_reqs, num_kv_heads) * row_floats,
                                        dtype=torch.float32, device=device),
            layer=(num_heads, num_kv_heads, head_dim, max_query_rows),
        )

    def warm_up(self, block_size: int, chunk_size: int) -> None:
        """Compile the kernel before serving, for both query-row counts the
        planner scores (1 and ``max_query_rows``): a first compile takes
        seconds. Call once block and chunk size are known; a no-op on the
        torch path."""
        if not self.use_kernel:
            return
        from vllm_specextend.retrieval.kernels.scoring_triton import warm_up

        assert self.layer is not None and self.granule_logsumexp is not None
        max_query_rows = self.layer[3]
        for rows in sorted({1, max_query_rows}):
            warm_up(self, rows, block_size, chunk_size)

    @property
    def nbytes(self) -> int:
        buffers = (self.keys, self.queries, self.logits_model_dtype, self.logits,
                   self.block_ids, self.slots, self.granule_logsumexp, self.split_logsumexp)
        return sum(t.numel() * t.element_size() for t in buffers if t is not None)

    def view(self, buffer: torch.Tensor, *shape: int) -> torch.Tensor:
        count = 1
        for size in shape:
            count *= size
        return buffer[:count].view(*shape)


def chunk_attention_sums(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    key_buffer: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    scale: float,
    block_size: int,
    chunk_size: int,
    workspace: ScoringWorkspace,
) -> torch.Tensor:
    """Softmax attention each chunk receives, summed over its tokens, the
    heads and the query rows.

    Args:
        queries: ``[batch, rows, num_heads, head_dim]`` post-RoPE queries.
        query_positions: ``[batch, rows]``; a row attends to positions ``<=``
            its own; rows at a negative position are padding (no scores).
        key_buffer: ``[num_slots, num_kv_heads, head_dim]`` keys by KV slot.
        block_table: ``[batch, max_blocks]`` block ids of each request.
        max_context_len: positions to score (the longest context, host int).
    Returns:
        ``[batch, ceil(max_context_len / chunk_size)]`` float32 sums; divide
        by :func:`chunk_token_counts` for the mean per token.
    """
    if workspace.use_kernel:
        from vllm_specextend.retrieval.kernels.scoring_triton import chunk_attention_sums_triton

        return chunk_attention_sums_triton(
            queries, query_positions, key_buffer, block_table, max_context_len, scale,
            block_size, chunk_size, workspace.granule_logsumexp, workspace.split_logsumexp,
        )
    batch = queries.shape[0]
    num_chunks = -(-max_context_len // chunk_size)
    sums = torch.zeros(batch, num_chunks, dtype=torch.float32, device=queries.device)
    if batch == 0 or num_chunks == 0:
        return sums
    # Rows per group, and positions per tile: a whole number of chunks.
    rows_per_group = max(1, min(batch, workspace.tile_tokens // chunk_size))
    tile_len = max(chunk_size, workspace.tile_tokens // rows_per_group // chunk_size * chunk_size)
    tiles = [(start, min(tile_len, max_context_len - start))
             for start in range(0, max_context_len, tile_len)]
    for first in range(0, batch, rows_per_group):
        rows = slice(first, min(batch, first + rows_per_group))
        _RowGroupScorer(
            queries[rows], query_positions[rows], key_buffer, block_table[rows],
            scale, block_size, workspace,
        ).add_chunk_sums(tiles, chunk_size, sums[rows])
    return sums


class _RowGroupScorer:
    """Two-pass softmax over the context tiles of a group of batch rows."""

    def __init__(self, queries, query_positions, key_buffer, block_table, scale,
                 block_size, workspace: ScoringWorkspace) -> None:
        num_rows, rows, num_heads, head_dim = queries.shape
        num_kv_heads = key_buffer.shape[1]
        group = num_heads // num_kv_heads
        self.shape = (num_kv_heads, num_rows, rows, group)
        # [kv head, row, query row, group, dim]: one batched matmul per KV head.
        q = workspace.view(workspace.queries, *self.shape, head_dim)
        q.copy_(queries.view(num_rows, rows, num_kv_heads, group, head_dim).permute(2, 0, 1, 3, 4))
        self.q = q.view(num_kv_heads, num_rows, rows * group, head_dim)
        self.query_positions = query_positions
        self.key_buffer = key_buffer
        self.block_table = block_table
        self.scale = scale
        self.block_size = block_size
        self.workspace = workspace
        # Padding rows (negative position) contribute nothing.
        self.row_weight = (query_positions >= 0).float().view(1, num_rows, rows, 1, 1)

    def add_chunk_sums(self, tiles, chunk_size: int, out: torch.Tensor) -> None:
        device = self.q.device
        running_max = torch.full(self.shape, _NO_LOGIT, dtype=torch.float32, device=device)
        running_sum = torch.zeros(self.shape, dtype=torch.float32, device=device)
        for start, length in tiles:
            logits = self.logits(start, length)
            new_max = torch.maximum(logits.amax(dim=-1), running_max)
            running_sum.mul_(torch.exp(running_max - new_max))
            running_max = new_max
            running_sum.add_(logits.sub_(running_max.unsqueeze(-1)).exp_().sum(dim=-1))
        weight = self.row_weight / running_sum.clamp_(min=1e-30).unsqueeze(-1)
        # The last tile is still in the workspace, exponentiated against the
        # final maximum: score it first, then recompute the others.
        for index in reversed(range(len(tiles))):
            start, length = tiles[index]
            if index < len(tiles) - 1:
                logits = self.logits(start, length).sub_(running_max.unsqueeze(-1)).exp_()
            else:
                logits = self.workspace.view(self.workspace.logits, *self.shape, length)
            token_sums = logits.mul_(weight).sum(dim=(0, 2, 3))  # [num_rows, length]
            chunks = -(-length // chunk_size)
            token_sums = torch.nn.functional.pad(token_sums, (0, chunks * chunk_size - length))
            first_chunk = start // chunk_size
            out[:, first_chunk : first_chunk + chunks] += token_sums.view(
                -1, chunks, chunk_size
            ).sum(dim=-1)

    def logits(self, start: int, length: int) -> torch.Tensor:
        """Scaled, causally masked float32 logits of one tile."""
        ws = self.workspace
        num_kv_heads, num_rows, rows, group = self.shape
        head_dim = self.q.shape[-1]
        positions = torch.arange(start, start + length, device=self.q.device)
        block_ids = ws.view(ws.block_ids, num_rows, length)
        torch.index_select(self.block_table, 1, positions // self.block_size, out=block_ids)
        slots = ws.view(ws.slots, num_rows, length)
        torch.mul(block_ids, self.block_size, out=slots)
        slots.add_(positions % self.block_size).clamp_(0, self.key_buffer.shape[0] - 1)
        keys = ws.view(ws.keys, num_rows * length, num_kv_heads, head_dim)
        torch.index_select(self.key_buffer, 0, slots.view(-1), out=keys)
        keys = keys.view(num_rows, length, num_kv_heads, head_dim)
        logits_model = ws.view(ws.logits_model_dtype, num_kv_heads, num_rows, rows * group, length)
        for kv_head in range(num_kv_heads):
            # Strided keys of one KV head: BLAS reads them in place.
            torch.matmul(self.q[kv_head], keys[:, :, kv_head].transpose(1, 2),
                         out=logits_model[kv_head])
        logits = ws.view(ws.logits, *self.shape, length)
        logits.copy_(logits_model.view_as(logits)).mul_(self.scale)
        hidden = positions.view(1, 1, length) > self.query_positions.view(num_rows, rows, 1)
        return logits.masked_fill_(hidden.view(1, num_rows, rows, 1, length), _NO_LOGIT)


def chunk_token_counts(
    context_lens: torch.Tensor, num_chunks: int, chunk_size: int
) -> torch.Tensor:
    """``[batch, num_chunks]`` context tokens in each chunk."""
    chunk_start = torch.arange(num_chunks, device=context_lens.device) * chunk_size
    return (context_lens.view(-1, 1) - chunk_start.view(1, -1)).clamp(0, chunk_size)
