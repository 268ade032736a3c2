"""Triton kernels of ``core/scoring_triton.py`` (see its docstring), as plain
functions: ``scoring_triton._kernels`` jits them on first use, for the GPU or
for Triton's interpreter. Logits are kept in base 2 (scaled by log2(e)).

Granule log-sum-exps are laid out ``[row, query row, head, granule]``.
``granule_logsumexp_kernel`` runs to 76 lines: one program's loop over its
split, with its pointer arithmetic, reads best in one piece."""

import triton.language as tl


def granule_logsumexp_kernel(
    q_ptr, qpos_ptr, k_ptr, table_ptr, out_ptr,
    q_stride_b, q_stride_r, q_stride_h, q_stride_d,
    qpos_stride_b, qpos_stride_r,
    k_stride_slot, k_stride_h, k_stride_d,
    table_stride_b,
    num_rows, num_heads, max_context_len, num_slots, num_granules, tiles_per_split,
    scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, GRANULE: tl.constexpr,
    GRANULE_PAD: tl.constexpr, GRANULES_PER_TILE: tl.constexpr, PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """Per (row, split, KV head): the base-2 log-sum-exp of each granule's
    visible logits, for every query row x query head of the KV head."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    kv_head = tl.program_id(2)
    # Stacked rows of one tl.dot: query row r x query head kv_head * GROUP + g.
    m = tl.arange(0, BLOCK_M)
    query_row = m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = query_row < num_rows
    qpos = tl.load(qpos_ptr + row * qpos_stride_b + query_row * qpos_stride_r,
                   mask=row_ok, other=-1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * q_stride_b + query_row[:, None] * q_stride_r
                + head[:, None] * q_stride_h + d[None, :] * q_stride_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # DOT_IN_FP32: the interpreter multiplies bf16 as raw 16-bit integers
    # (triton 3.9); bf16 products are exact in float32, so the sums agree.
    dot_dtype = tl.float32 if DOT_IN_FP32 else k_ptr.dtype.element_ty
    q = q.to(dot_dtype)
    last_visible = tl.minimum(tl.max(qpos, axis=0), max_context_len - 1)

    TILE: tl.constexpr = GRANULES_PER_TILE * GRANULE_PAD
    TILE_SPAN: tl.constexpr = GRANULES_PER_TILE * GRANULE  # positions a tile covers
    t = tl.arange(0, TILE)
    local_granule = t // GRANULE_PAD
    within = t % GRANULE_PAD
    g = tl.arange(0, GRANULES_PER_TILE)
    table_row = table_ptr + row * table_stride_b
    out_rows = out_ptr + ((row * num_rows + query_row) * num_heads + head).to(tl.int64) * num_granules
    store_ok = row_ok[:, None]
    # Tiles holding a visible position are scored (keys past the row's last
    # visible position are never loaded); the rest only get -inf.
    first_tile = split * tiles_per_split
    end_tile = first_tile + tiles_per_split
    live_tiles = (last_visible + TILE_SPAN) // TILE_SPAN
    live_end = tl.minimum(end_tile, tl.maximum(live_tiles, first_tile)).to(tl.int32)
    for tile in tl.range(first_tile, live_end, num_stages=3):
        granule0 = tile * GRANULES_PER_TILE
        pos = (granule0 + local_granule).to(tl.int64) * GRANULE + within
        pos_ok = (within < GRANULE) & (pos <= last_visible)
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = tl.minimum(tl.maximum(block * BLOCK_SIZE + pos % BLOCK_SIZE, 0), num_slots - 1)
        k = tl.load(k_ptr + slot[:, None] * k_stride_slot + kv_head * k_stride_h
                    + d[None, :] * k_stride_d,
                    mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        logits = tl.dot(q, tl.trans(k.to(dot_dtype)), input_precision=PRECISION) * scale_log2
        visible = pos_ok[None, :] & (pos[None, :] <= qpos[:, None])
        logits = tl.where(visible, logits, -float("inf"))
        logits = tl.reshape(logits, (BLOCK_M, GRANULES_PER_TILE, GRANULE_PAD))
        peak = tl.max(logits, axis=2)
        peak = tl.where(peak == -float("inf"), 0.0, peak)
        total = tl.sum(tl.exp2(logits - peak[:, :, None]), axis=2)
        lse = tl.where(total > 0.0, peak + tl.log2(tl.maximum(total, 1e-30)), -float("inf"))
        granule = granule0 + g
        tl.store(out_rows[:, None] + granule[None, :], lse,
                 mask=store_ok & (granule < num_granules)[None, :])
    for tile in range(live_end, end_tile):
        granule = tile * GRANULES_PER_TILE + g
        tl.store(out_rows[:, None] + granule[None, :],
                 tl.full((BLOCK_M, GRANULES_PER_TILE), -float("inf"), tl.float32),
                 mask=store_ok & (granule < num_granules)[None, :])


def row_logsumexp_kernel(
    lse_ptr, out_ptr, heads_rows, num_granules,
    BLOCK_RH: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """Per (row, block of query rows x heads): the softmax normaliser, the
    log-sum-exp over all granules; +inf where nothing is visible (padding
    rows), so their weights 2^(granule - normaliser) are 0."""
    row = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1) * BLOCK_RH + tl.arange(0, BLOCK_RH)
    rh_ok = rh < heads_rows
    base = lse_ptr + (row * heads_rows + rh).to(tl.int64) * num_granules
    peak = tl.full((BLOCK_RH,), -float("inf"), tl.float32)
    total = tl.zeros((BLOCK_RH,), tl.float32)
    for start in range(0, num_granules, BLOCK_G):
        g = start + tl.arange(0, BLOCK_G)
        lse = tl.load(base[:, None] + g[None, :], mask=rh_ok[:, None] & (g < num_granules)[None, :],
                      other=-float("inf"))
        new_peak = tl.maximum(peak, tl.max(lse, axis=1))
        safe = tl.where(new_peak == -float("inf"), 0.0, new_peak)
        total = total * tl.exp2(peak - safe)
        total += tl.sum(tl.exp2(lse - safe[:, None]), axis=1)
        peak = new_peak
    normaliser = tl.where(total > 0.0, peak + tl.log2(tl.maximum(total, 1e-30)), float("inf"))
    tl.store(out_ptr + row * heads_rows + rh, normaliser, mask=rh_ok)


def chunk_sum_kernel(
    lse_ptr, norm_ptr, out_ptr, heads_rows, num_granules, num_chunks, out_stride_b,
    GRANULES_PER_CHUNK: tl.constexpr, BLOCK_RH: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per (row, block of chunks): each chunk's probability mass, summed
    over query rows, heads and the chunk's granules."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_C,), tl.float32)
    for rh_start in range(0, heads_rows, BLOCK_RH):
        rh = rh_start + tl.arange(0, BLOCK_RH)
        rh_ok = rh < heads_rows
        norm = tl.load(norm_ptr + row * heads_rows + rh, mask=rh_ok, other=float("inf"))
        base = lse_ptr + (row * heads_rows + rh).to(tl.int64) * num_granules
        for j in range(GRANULES_PER_CHUNK):
            g = c * GRANULES_PER_CHUNK + j
            lse = tl.load(base[:, None] + g[None, :],
                          mask=rh_ok[:, None] & (g < num_granules)[None, :], other=-float("inf"))
            acc += tl.sum(tl.exp2(lse - norm[:, None]), axis=0)
    tl.store(out_ptr + row * out_stride_b + c, acc, mask=c < num_chunks)


def gather_query_rows_kernel(
    rows_ptr, last_ptr, start_ptr, positions_ptr, q_ptr, table_ptr,
    q_out_ptr, qpos_out_ptr, table_out_ptr,
    q_stride_t, table_stride, table_out_stride, num_blocks,
    QUERY_ROWS: tl.constexpr, HEAD_ELEMS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Per scored batch row: the last ``QUERY_ROWS`` query tokens' queries
    and positions (-1 before the row's first query token), and its block
    table row, gathered into the scoring inputs."""
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    last = tl.load(last_ptr + row).to(tl.int64)
    first = tl.load(start_ptr + row).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    for r in range(QUERY_ROWS):
        index = last - r
        position = tl.load(positions_ptr + tl.maximum(index, 0))
        tl.store(qpos_out_ptr + i * QUERY_ROWS + r, tl.where(index >= first, position, -1))
        source = q_ptr + tl.maximum(index, 0) * q_stride_t
        target = q_out_ptr + (i * QUERY_ROWS + r) * HEAD_ELEMS
        for start in range(0, HEAD_ELEMS, BLOCK_E):
            ok = start + e < HEAD_ELEMS
            tl.store(target + start + e, tl.load(source + start + e, mask=ok), mask=ok)
    b = tl.arange(0, BLOCK_B)
    for start in range(0, num_blocks, BLOCK_B):
        ok = start + b < num_blocks
        tl.store(table_out_ptr + i * table_out_stride + start + b,
                 tl.load(table_ptr + row * table_stride + start + b, mask=ok), mask=ok)


def chunk_means_kernel(
    sums_ptr, rows_ptr, seq_lens_ptr, slots_ptr, out_ptr,
    sums_stride, out_stride, num_chunks, out_chunks, chunk_size,
    ACCUMULATE: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per (scored row, block of chunks): the mean score per context token of
    each chunk, added to (``ACCUMULATE``) or written over (the rest of the
    row zeroed) the row's request slot in ``out``."""
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    context = tl.load(seq_lens_ptr + tl.load(rows_ptr + i)).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    width = tl.minimum(num_chunks, out_chunks)
    in_width = c < width
    sums = tl.load(sums_ptr + i * sums_stride + c, mask=in_width, other=0.0)
    count = tl.minimum(tl.maximum(context - c.to(tl.int64) * chunk_size, 0), chunk_size)
    mean = sums / tl.maximum(count, 1).to(tl.float32)
    target = out_ptr + slot * out_stride + c
    if ACCUMULATE:
        tl.store(target, tl.load(target, mask=in_width, other=0.0) + mean, mask=in_width)
    else:
        tl.store(target, tl.where(in_width, mean, 0.0), mask=c < out_chunks)
