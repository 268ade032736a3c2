"""Chunk scores in one read of the keys: a Triton kernel for
:func:`vllm_specextend.core.scoring.chunk_attention_sums` on CUDA.

What it computes is the torch path's (``core/scoring.py``, the reference on
CPU): the softmax attention each chunk of the context receives from a row's
query rows, summed over the chunk's tokens, the heads and the query rows, in
float32, with GQA, the causal limit of each query row, padding rows (negative
position, no scores) and ragged contexts.

Where the keys are read: the tap's slot-indexed key buffer
(``core/target_tap.py``), through the block table. The paged KV cache would
save the tap's copy (one layer's keys, 1 / (2 x layers) of the KV cache) but
its layout is the attention backend's (FlashAttention, FlashInfer, FP8 with
scales, the CPU backend's per-ISA packing), so reading it would tie the
kernel to each backend; the tap's buffer has one layout everywhere. The
kernel takes the buffer's slot and head strides, so a backend whose keys
form ``[num_blocks * block_size, kv_heads, head_dim]`` could be passed
in place of the tap's buffer later without changing it.

Three launches, none of which re-reads a key:

1. ``_granule_logsumexp_kernel``, grid (row, split of the context, KV head).
   The query heads of one KV head x the query rows are stacked into one tile
   of >= 16 rows (padded), so the logits of a tile of keys are one
   tensor-core ``tl.dot``. For each "granule" (a chunk, or an equal part of
   a long chunk) it stores the log-sum-exp (base 2) of its visible logits per
   query row and head: no per-split maximum is needed, because a granule's
   log-sum-exp already carries its own scale. Keys past the row's last
   visible position are not loaded.
2. ``_row_logsumexp_kernel``, grid (row, block of query rows x heads): each
   softmax's normaliser, the log-sum-exp over the granules (+inf for a
   padding row, so that its weights come out 0).
3. ``_chunk_sum_kernel``, grid (row, block of chunks): each chunk's score,
   ``sum over query rows, heads and its granules of 2^(granule - row)``.

The granule log-sum-exps (4 bytes per query row x head x granule, ~1% of
the keys' bytes at chunk 32) live in the :class:`ScoringWorkspace`, sized
when it is allocated; a batch larger than they hold is scored in groups of
rows. Nothing here reads a device value on the host.
"""

from __future__ import annotations

import functools
import math
import os

import torch

TILE_POSITIONS = 64
"""Key positions per ``tl.dot`` (a tile of 64 x 128 bf16 keys is 16 KiB)."""
MAX_GRANULE = 128
"""Longest granule; a longer chunk is scored as equal granules of at most this."""
TARGET_PROGRAMS = 2048
"""Programs the first launch aims for (splits are shortened until it has them)."""
MIN_SPLIT_TILES = 4
"""Tiles per split at least (fewer would spend more time on Q loads than keys)."""
# Tiles of the two small launches: 16 x 128 and 64 x 64 floats (128 threads;
# compiled for sm_90 neither spills, see tests/core/test_scoring_triton.py).
ROWS_BLOCK_RH, ROWS_BLOCK_G = 16, 128
CHUNKS_BLOCK_RH, CHUNKS_BLOCK_C = 64, 64
GATHER_BLOCK = 1024
"""Query elements / block-table entries the gather copies per loop step."""
MEANS_BLOCK_C = 256
"""Chunks per program of the chunk-means store."""


def granule_size(chunk_size: int) -> int:
    """The part of a chunk one granule covers: the chunk itself up to
    :data:`MAX_GRANULE`, else the largest divisor of it at most that long
    whose power-of-two padding wastes at most a quarter (else the largest)."""
    if chunk_size <= MAX_GRANULE:
        return chunk_size
    divisors = [d for d in range(MAX_GRANULE, 0, -1) if chunk_size % d == 0]
    snug = [d for d in divisors if 4 * d >= 3 * _next_power_of_2(d)]
    return (snug or divisors)[0]


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def chunk_attention_sums_triton(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    key_buffer: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    scale: float,
    block_size: int,
    chunk_size: int,
    granule_logsumexp: torch.Tensor,
    row_logsumexp: torch.Tensor,
) -> torch.Tensor:
    """``chunk_attention_sums`` on the kernel (arguments as there; the last
    two are the workspace's flat float32 buffers). CPU tensors run under
    Triton's interpreter (tests). Launches only: no host sync. (Long as the
    three launches' shared sizes and grids, which one place keeps in step.)"""
    batch, rows, num_heads, head_dim = queries.shape
    num_kv_heads = key_buffer.shape[1]
    group = num_heads // num_kv_heads
    num_chunks = -(-max_context_len // chunk_size)
    sums = torch.empty(batch, num_chunks, dtype=torch.float32, device=queries.device)
    if batch == 0 or num_chunks == 0:
        return sums.zero_()
    granule = granule_size(chunk_size)
    granules = -(-max_context_len // granule)
    per_row = rows * num_heads * granules
    rows_per_launch = min(batch, granule_logsumexp.numel() // per_row,
                          row_logsumexp.numel() // (rows * num_heads))
    if rows_per_launch < 1:
        raise ValueError(
            f"scoring workspace holds {granule_logsumexp.numel()} granule sums, one row of "
            f"{max_context_len} tokens needs {per_row}: allocate ScoringWorkspace with "
            f"max_context_len >= {max_context_len}"
        )
    _check_device(queries)
    kernels = _kernels()
    granule_pad = _next_power_of_2(granule)
    granules_per_tile = max(1, TILE_POSITIONS // granule_pad)
    tiles = -(-granules // granules_per_tile)
    block_m = max(16, _next_power_of_2(rows * group))
    block_d = max(16, _next_power_of_2(head_dim))
    interpreted = queries.device.type != "cuda"
    dot_in_fp32 = interpreted and key_buffer.dtype == torch.bfloat16
    precision = "ieee" if key_buffer.dtype == torch.float32 or dot_in_fp32 else "tf32"
    for first in range(0, batch, rows_per_launch):
        count = min(rows_per_launch, batch - first)
        tiles_per_split = _tiles_per_split(tiles, count * num_kv_heads)
        splits = -(-tiles // tiles_per_split)
        lse = granule_logsumexp[: count * per_row].view(count, rows, num_heads, granules)
        row_lse = row_logsumexp[: count * rows * num_heads].view(count, rows * num_heads)
        q = queries[first : first + count]
        qpos = query_positions[first : first + count]
        table = block_table[first : first + count]
        kernels.granules[(count, splits, num_kv_heads)](
            q, qpos, key_buffer, table, lse,
            q.stride(0), q.stride(1), q.stride(2), q.stride(3),
            qpos.stride(0), qpos.stride(1),
            key_buffer.stride(0), key_buffer.stride(1), key_buffer.stride(2),
            table.stride(0),
            rows, num_heads, max_context_len, key_buffer.shape[0], granules, tiles_per_split,
            scale * math.log2(math.e),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
            BLOCK_SIZE=block_size, GRANULE=granule, GRANULE_PAD=granule_pad,
            GRANULES_PER_TILE=granules_per_tile, PRECISION=precision, DOT_IN_FP32=dot_in_fp32,
            num_warps=8 if block_m >= 128 else 4,  # 128 stacked rows: logits of 64 floats a thread

        )
        heads_rows = rows * num_heads
        kernels.rows[(count, -(-heads_rows // ROWS_BLOCK_RH))](
            lse, row_lse, heads_rows, granules, BLOCK_RH=ROWS_BLOCK_RH, BLOCK_G=ROWS_BLOCK_G,
            num_warps=4,
        )
        out = sums[first : first + count]
        kernels.chunks[(count, -(-num_chunks // CHUNKS_BLOCK_C))](
            lse, row_lse, out, heads_rows, granules, num_chunks, out.stride(0),
            GRANULES_PER_CHUNK=chunk_size // granule, BLOCK_RH=CHUNKS_BLOCK_RH,
            BLOCK_C=CHUNKS_BLOCK_C, num_warps=4,
        )
    return sums


def gather_query_rows(
    rows: torch.Tensor,
    last_token_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    queries: torch.Tensor,
    block_table: torch.Tensor,
    num_query_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scoring inputs of batch ``rows`` in one launch: the queries
    ``[rows, num_query_rows, heads, head_dim]`` of each row's last
    ``num_query_rows`` tokens (the last first), their positions (-1 before
    the row's first query token: padding) and the rows' block tables.
    ``queries`` is the tap's ``[tokens, heads, head_dim]`` buffer."""
    num = rows.shape[0]
    _, num_heads, head_dim = queries.shape
    device = queries.device
    query_rows = torch.empty(num, num_query_rows, num_heads, head_dim, dtype=queries.dtype,
                             device=device)
    query_positions = torch.empty(num, num_query_rows, dtype=positions.dtype, device=device)
    tables = torch.empty(num, block_table.shape[1], dtype=block_table.dtype, device=device)
    if num:
        _check_device(queries)
        head_elems = num_heads * head_dim
        _kernels().gather[(num,)](
            rows, last_token_indices, query_start_loc, positions, queries, block_table,
            query_rows, query_positions, tables,
            queries.stride(0), block_table.stride(0), tables.stride(0), block_table.shape[1],
            QUERY_ROWS=num_query_rows, HEAD_ELEMS=head_elems,
            BLOCK_E=min(GATHER_BLOCK, _next_power_of_2(head_elems)), BLOCK_B=GATHER_BLOCK,
            num_warps=4,
        )
    return query_rows, query_positions, tables


def store_chunk_means(
    sums: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    chunk_size: int,
    accumulate: bool,
) -> None:
    """Each chunk's sum over its context tokens (``seq_lens`` of the batch
    ``rows``) as a mean per token, added to ``out[slots]`` or written over
    it (the rest of each row zeroed), in one launch."""
    num, num_chunks = sums.shape
    if not num:
        return
    _check_device(sums)
    _kernels().means[(num, -(-out.shape[1] // MEANS_BLOCK_C))](
        sums, rows, seq_lens, slots, out,
        sums.stride(0), out.stride(0), num_chunks, out.shape[1], chunk_size,
        ACCUMULATE=accumulate, BLOCK_C=MEANS_BLOCK_C, num_warps=4,
    )


def warm_up(workspace, num_heads: int, num_kv_heads: int, head_dim: int, rows: int,
            dtype: torch.dtype, block_size: int, chunk_size: int) -> None:
    """One call of each kernel on a one-block context with the argument
    types the planner passes (int64 rows and positions, int32 query starts,
    sequence lengths and block table), so that its first planning call finds
    the kernels compiled."""
    device = workspace.granule_logsumexp.device
    rows_t = torch.zeros(1, dtype=torch.int64, device=device)
    index = torch.zeros(2, dtype=torch.int32, device=device)
    gather_query_rows(rows_t, index[:1], index, rows_t,
                      torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device),
                      index.view(1, 2), rows)
    for accumulate in (False, True):
        store_chunk_means(torch.zeros(1, 1, device=device), rows_t, index, rows_t,
                          torch.zeros(1, 1, device=device), chunk_size, accumulate)
    chunk_attention_sums_triton(
        torch.zeros(1, rows, num_heads, head_dim, dtype=dtype, device=device),
        torch.zeros(1, rows, dtype=torch.int64, device=device),
        torch.zeros(block_size + 1, num_kv_heads, head_dim, dtype=dtype, device=device),
        torch.zeros(1, 1, dtype=torch.int32, device=device),
        1, head_dim ** -0.5, block_size, chunk_size,
        workspace.granule_logsumexp, workspace.row_logsumexp,
    )


def _tiles_per_split(tiles: int, programs_per_split: int) -> int:
    """Tiles per split: as long as the launch still has TARGET_PROGRAMS."""
    splits_wanted = max(1, TARGET_PROGRAMS // max(1, programs_per_split))
    per_split = max(MIN_SPLIT_TILES, -(-tiles // splits_wanted))
    return min(tiles, _next_power_of_2(per_split))


def _check_device(tensor: torch.Tensor) -> None:
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton scoring kernels run on CPU tensors only under "
                           "TRITON_INTERPRET=1, set before triton is imported")


class _Kernels:
    def __init__(self, granules, rows, chunks, gather, means) -> None:
        self.granules, self.rows, self.chunks = granules, rows, chunks
        self.gather, self.means = gather, means


@functools.cache
def _kernels() -> _Kernels:
    """The kernels, jitted on first use (triton imported lazily). On
    CPU tensors they run only under Triton's interpreter, which
    TRITON_INTERPRET=1 selects for the whole process when triton is first
    imported (``triton.language``'s own helpers are jitted then)."""
    import triton

    from vllm_specextend.core import _scoring_triton_kernels as source

    # Integers that change from call to call are not specialised on (==1,
    # divisible by 16): each new value would otherwise compile a new kernel.
    return _Kernels(
        triton.jit(source.granule_logsumexp_kernel, do_not_specialize=[
            "q_stride_b", "q_stride_r", "q_stride_h", "qpos_stride_b", "qpos_stride_r",
            "table_stride_b", "num_rows", "max_context_len", "num_slots", "num_granules",
            "tiles_per_split"]),
        triton.jit(source.row_logsumexp_kernel,
                   do_not_specialize=["heads_rows", "num_granules"]),
        triton.jit(source.chunk_sum_kernel, do_not_specialize=[
            "heads_rows", "num_granules", "num_chunks", "out_stride_b"]),
        triton.jit(source.gather_query_rows_kernel, do_not_specialize=[
            "q_stride_t", "table_stride", "table_out_stride", "num_blocks"]),
        triton.jit(source.chunk_means_kernel, do_not_specialize=[
            "sums_stride", "out_stride", "num_chunks", "out_chunks", "chunk_size"]),
    )
