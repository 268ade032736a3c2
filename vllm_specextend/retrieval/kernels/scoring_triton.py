"""Chunk scores in one read of the keys: Triton kernels for
:func:`vllm_specextend.retrieval.kernels.scoring.chunk_attention_sums` on CUDA, and the
planner's scoring step in two launches (:func:`score_rows_triton`).

What they compute is the torch path's (``retrieval/kernels/scoring.py``, the reference on
CPU): the softmax attention each chunk of the context receives from a row's
query rows, summed over the chunk's tokens, the heads and the query rows, in
float32, with GQA, the causal limit of each query row, padding rows (negative
position, no scores) and ragged contexts.

Where the keys are read: the tap's slot-indexed key buffer
(``retrieval/target_tap.py``), through the block table. The paged KV cache would
save the tap's copy (one layer's keys, 1 / (2 x layers) of the KV cache) but
its layout is the attention backend's (FlashAttention, FlashInfer, FP8 with
scales, the CPU backend's per-ISA packing), so reading it would tie the
kernel to each backend; the tap's buffer has one layout everywhere. The
kernel takes the buffer's slot and head strides, so a backend whose keys
form ``[num_blocks * block_size, kv_heads, head_dim]`` could be passed
in place of the tap's buffer later without changing it.

Two launches, neither of which re-reads a key:

1. ``granule_logsumexp_kernel``, grid (work item, KV head). An item is a
   run of tiles of one row: the planner's items come from a work list built
   on the host from the rows' lengths (``retrieval/kernels/scoring_work.py``), so a long
   row in a batch of short ones is read by as many programs as its length
   asks for; :func:`chunk_attention_sums_triton`'s rows all have the
   longest row's items. The query heads of one KV head x the query rows are
   stacked into one tile of >= 16 rows (padded), so the logits of a tile of
   keys are one tensor-core ``tl.dot``; the planner's query rows are read
   straight from the tap by each row's last token (no gather launch). For
   each "granule" (a chunk, or an equal part of a long chunk) it stores the
   log-sum-exp (base 2) of its visible logits per query row and head, and
   per item their log-sum-exp: no per-split maximum is needed, because a
   log-sum-exp already carries its own scale. Keys past the row's last
   visible position are not loaded.
2. ``chunk_scores_kernel``, grid (row, block of chunks): each softmax's
   normaliser from the row's item sums (+inf for a padding row, so that
   its weights come out 0), then each chunk's score, ``sum over query rows,
   heads and its granules of 2^(granule - normaliser)``, written as sums,
   or for the planner as means per context token into the request slots.

The granule log-sum-exps (4 bytes per query row x head x granule, ~1% of
the keys' bytes at chunk 32) live in the :class:`ScoringWorkspace`, sized
when it is allocated; a batch larger than they hold is scored in groups of
rows. Nothing here reads a device value on the host.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch

from vllm_specextend.retrieval.kernels.scoring_work import (
    MIN_SPLIT_TILES,
    TARGET_PROGRAMS,
    StagedWork,
    WorkLists,
)

TILE_POSITIONS = 64
"""Key positions per ``tl.dot`` (a tile of 64 x 128 bf16 keys is 16 KiB)."""
MAX_GRANULE = 128
"""Longest granule; a longer chunk is scored as equal granules of at most this."""
# Tile of the chunk-score launch: 32 x 128 floats (128 threads; compiled for
# sm_90 it does not spill, see tests/retrieval/test_scoring_triton.py), and the
# items' sums read per step of the normaliser.
CHUNKS_BLOCK_RH, CHUNKS_BLOCK_C, SPLITS_BLOCK = 32, 128, 16
MEANS_BLOCK_C = 256
"""Chunks per program of the chunk-means store."""
SUMS, MEANS, ADD_MEANS = 0, 1, 2
"""What the chunk-score launch writes."""


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


class _Shape:
    """Sizes both launches share, for one layer, chunk size and query rows
    (made once for each: :func:`_shape`)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, rows: int,
                 chunk_size: int, key_dtype: torch.dtype, device_type: str) -> None:
        self.group = num_heads // num_kv_heads
        self.granule = granule_size(chunk_size)
        self.granule_pad = _next_power_of_2(self.granule)
        self.granules_per_tile = max(1, TILE_POSITIONS // self.granule_pad)
        self.heads_rows = rows * num_heads
        interpreted = device_type != "cuda"
        dot_in_fp32 = interpreted and key_dtype == torch.bfloat16
        block_m = max(16, _next_power_of_2(rows * self.group))
        self.constants = dict(
            GROUP=self.group, HEAD_DIM=head_dim, BLOCK_D=max(16, _next_power_of_2(head_dim)),
            BLOCK_M=block_m, GRANULE=self.granule, GRANULE_PAD=self.granule_pad,
            GRANULES_PER_TILE=self.granules_per_tile,
            PRECISION="ieee" if key_dtype == torch.float32 or dot_in_fp32 else "tf32",
            DOT_IN_FP32=dot_in_fp32,
            num_warps=8 if block_m >= 128 else 4,  # 128 stacked rows: logits of 64 floats a thread
        )
        self.chunk_constants = dict(
            GRANULES_PER_CHUNK=chunk_size // self.granule, BLOCK_RH=CHUNKS_BLOCK_RH,
            BLOCK_C=CHUNKS_BLOCK_C, BLOCK_S=SPLITS_BLOCK, num_warps=4)


_shape = functools.cache(_Shape)


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
    split_logsumexp: torch.Tensor,
) -> torch.Tensor:
    """``chunk_attention_sums`` on the kernels (arguments as there; the last
    two are the workspace's flat float32 buffers), every row scored up to
    ``max_context_len``. CPU tensors run under Triton's interpreter (tests).
    Launches only: no host sync."""
    batch, rows, num_heads, head_dim = queries.shape
    num_kv_heads = key_buffer.shape[1]
    num_chunks = -(-max_context_len // chunk_size)
    sums = torch.empty(batch, num_chunks, dtype=torch.float32, device=queries.device)
    if batch == 0 or num_chunks == 0:
        return sums.zero_()
    _check_device(queries)
    shape = _shape(num_heads, head_dim, num_kv_heads, rows, chunk_size, key_buffer.dtype,
                   queries.device.type)
    granules = -(-max_context_len // shape.granule)
    per_row = shape.heads_rows * granules
    rows_per_launch = min(batch, granule_logsumexp.numel() // per_row)
    if rows_per_launch < 1:
        raise ValueError(
            f"scoring workspace holds {granule_logsumexp.numel()} granule sums, one row of "
            f"{max_context_len} tokens needs {per_row}: allocate ScoringWorkspace with "
            f"max_context_len >= {max_context_len}"
        )
    kernels = _kernels()
    tiles = -(-granules // shape.granules_per_tile)
    for first in range(0, batch, rows_per_launch):
        count = min(rows_per_launch, batch - first)
        tiles_per_split = _tiles_per_split(count * tiles, num_kv_heads)
        splits = -(-tiles // tiles_per_split)
        if count * splits * shape.heads_rows > split_logsumexp.numel():
            raise ValueError(f"scoring workspace holds {split_logsumexp.numel()} split sums, "
                             f"{count} rows of {rows} query rows need more: allocate it for "
                             f"{batch} requests")
        q = queries[first : first + count]
        qpos = query_positions[first : first + count]
        table = block_table[first : first + count]
        kernels.granules[(count * splits, num_kv_heads)](
            q, qpos, qpos, qpos, qpos, key_buffer, table, qpos, granule_logsumexp,
            split_logsumexp, *q.stride(), *qpos.stride(), *key_buffer.stride(), table.stride(0),
            rows, num_heads, key_buffer.shape[0], 0, 0, tiles_per_split, splits, granules,
            max_context_len, scale * math.log2(math.e),
            BLOCK_SIZE=block_size, WORK_LIST=False, **shape.constants,
        )
        out = sums[first : first + count]
        kernels.chunks[(count, -(-num_chunks // CHUNKS_BLOCK_C))](
            granule_logsumexp, split_logsumexp, qpos, qpos, qpos, qpos, out,
            shape.heads_rows, 0, out.stride(0), num_chunks, chunk_size, splits, granules,
            WORK_LIST=False, OUTPUT=SUMS, **shape.chunk_constants,
        )
    return sums


def stage_work(work_lists: WorkLists, seq_lens: np.ndarray, num_query_rows: int,
               chunk_size: int, workspace) -> StagedWork:
    """The work list of rows of ``seq_lens`` tokens (host int64), staged,
    for :func:`score_rows_triton` on ``workspace`` (a kernel
    ``ScoringWorkspace``)."""
    num_heads, num_kv_heads, head_dim, _ = workspace.layer
    shape = _shape(num_heads, head_dim, num_kv_heads, num_query_rows, chunk_size,
                   workspace.keys.dtype, workspace.granule_logsumexp.device.type)
    return work_lists.stage(seq_lens, chunk_size, shape.granule, shape.granules_per_tile,
                            num_kv_heads, workspace.granule_logsumexp.numel() // shape.heads_rows)


def score_rows_triton(
    work: StagedWork,
    rows: torch.Tensor,
    queries: torch.Tensor,
    positions: torch.Tensor,
    last_token_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    key_buffer: torch.Tensor,
    num_query_rows: int,
    scale: float,
    block_size: int,
    chunk_size: int,
    workspace,
    out: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Chunk scores of batch ``rows`` (the rows ``work`` was staged for, by
    :func:`stage_work`) from each row's last ``num_query_rows`` tokens: the
    tap's ``queries`` (``[tokens, heads, head_dim]``) at ``positions``, the
    batch's last token indices, query starts, sequence lengths and block
    table. With ``out`` and ``slots``: each chunk's mean per context token
    written over (``accumulate``: added to) ``out[slots[i]]``, the rest of
    the row zeroed; else returns the sums ``[rows, chunks of the longest]``.
    Two launches a row group (one group unless the batch outgrows the
    workspace); no host sync."""
    num_heads, head_dim = queries.shape[1:]
    num_kv_heads = key_buffer.shape[1]
    if out is None:
        out = torch.empty(work.num_rows, work.max_chunks, dtype=torch.float32,
                          device=queries.device)
        output = SUMS
    else:
        output = ADD_MEANS if accumulate else MEANS
    if not work.num_rows:
        return out
    _check_device(queries)
    shape = _shape(num_heads, head_dim, num_kv_heads, num_query_rows, chunk_size,
                   key_buffer.dtype, queries.device.type)
    kernels = _kernels()
    lse, split_lse = workspace.granule_logsumexp, workspace.split_logsumexp
    slots = rows if slots is None else slots
    chunk_blocks = -(-out.shape[1] // CHUNKS_BLOCK_C)
    for first_row, end_row, first_item, end_item in work.groups:
        if end_item > first_item:
            kernels.granules[(end_item - first_item, num_kv_heads)](
                queries, positions, last_token_indices, query_start_loc, rows, key_buffer,
                block_table, work.work, lse, split_lse,
                0, *queries.stride(), 0, positions.stride(0), *key_buffer.stride(),
                block_table.stride(0),
                num_query_rows, num_heads, key_buffer.shape[0], first_item, work.items_start,
                work.tiles_per_split, 1, 1, 1, scale * math.log2(math.e),
                BLOCK_SIZE=block_size, WORK_LIST=True, **shape.constants,
            )
        kernels.chunks[(end_row - first_row, chunk_blocks)](
            lse, split_lse, work.work, rows, seq_lens, slots, out,
            shape.heads_rows, first_row, out.stride(0), out.shape[1], chunk_size, 1, 1,
            WORK_LIST=True, OUTPUT=output, **shape.chunk_constants,
        )
    return out


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


def warm_up(workspace, rows: int, block_size: int, chunk_size: int,
            outputs: tuple[int, ...] = (SUMS, MEANS, ADD_MEANS)) -> None:
    """One planner's scoring call of each kind on a one-token context, with
    the argument types the planner passes (int64 rows, slots and positions,
    int32 last token indices, query starts, sequence lengths and block
    table), so that its first planning call finds the kernels compiled."""
    num_heads, num_kv_heads, head_dim, _ = workspace.layer
    device = workspace.granule_logsumexp.device
    dtype = workspace.keys.dtype
    work = stage_work(WorkLists(1, device, depth=2), np.ones(1, dtype=np.int64), rows,
                      chunk_size, workspace)
    rows_t = torch.zeros(1, dtype=torch.int64, device=device)
    index = torch.zeros(2, dtype=torch.int32, device=device)
    call = (work, rows_t, torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device),
            rows_t, index[:1], index, index, index.view(1, 2),
            torch.zeros(block_size, num_kv_heads, head_dim, dtype=dtype, device=device),
            rows, head_dim ** -0.5, block_size, chunk_size, workspace)
    for output in outputs:
        out = None if output == SUMS else torch.zeros(1, 1, device=device)
        score_rows_triton(*call, out=out, slots=rows_t, accumulate=output == ADD_MEANS)
    if SUMS in outputs:  # tensor-parallel ranks store the means after their sum
        for accumulate in (False, True):
            store_chunk_means(torch.zeros(1, 1, device=device), rows_t, index, rows_t,
                              torch.zeros(1, 1, device=device), chunk_size, accumulate)


def _tiles_per_split(tiles: int, num_kv_heads: int) -> int:
    """Tiles per item: a power of two, at least MIN_SPLIT_TILES, that gives
    the launch about TARGET_PROGRAMS programs (as ``scoring_work``'s)."""
    wanted = -(-tiles * num_kv_heads // TARGET_PROGRAMS)
    return max(MIN_SPLIT_TILES, _next_power_of_2(wanted))


def _check_device(tensor: torch.Tensor) -> None:
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton scoring kernels run on CPU tensors only under "
                           "TRITON_INTERPRET=1, set before triton is imported")


class _Kernels:
    def __init__(self, granules, chunks, means) -> None:
        self.granules, self.chunks, self.means = granules, chunks, means


@functools.cache
def _kernels() -> _Kernels:
    """The kernels, jitted on first use (triton imported lazily). On
    CPU tensors they run only under Triton's interpreter, which
    TRITON_INTERPRET=1 selects for the whole process when triton is first
    imported (``triton.language``'s own helpers are jitted then)."""
    import triton

    from vllm_specextend.retrieval.kernels import _scoring_triton_kernels as source

    # Integers that change from call to call are not specialised on (==1,
    # divisible by 16): each new value would otherwise compile a new kernel.
    return _Kernels(
        triton.jit(source.granule_logsumexp_kernel, do_not_specialize=[
            "q_stride_b", "q_stride_r", "q_stride_h", "qpos_stride_b", "qpos_stride_r",
            "table_stride_b", "num_rows", "num_slots", "first_item", "items_start",
            "tiles_per_split", "uniform_splits", "uniform_granules", "max_context_len"]),
        triton.jit(source.chunk_scores_kernel, do_not_specialize=[
            "heads_rows", "first_row", "out_stride", "out_chunks", "chunk_size",
            "uniform_splits", "uniform_granules"]),
        triton.jit(source.chunk_means_kernel, do_not_specialize=[
            "sums_stride", "out_stride", "num_chunks", "out_chunks", "chunk_size"]),
    )
