"""Triton kernels of ``retrieval/kernels/scoring_triton.py`` (see its docstring), as plain
functions: ``scoring_triton._kernels`` jits them on first use, for the GPU or
for Triton's interpreter. Logits are kept in base 2 (scaled by log2(e)).

Granule log-sum-exps are laid out ``[row, query row, head, granule]``, a
row's granules where its work list puts them (uniform rows back to back).
``granule_logsumexp_kernel`` runs to ~110 lines: one program's loop over its
item, with its pointer arithmetic and both ways of finding its row, reads
best in one piece."""

import triton.language as tl


# Over 80 lines on purpose: one Triton program, which reads best in one piece (see above).
def granule_logsumexp_kernel(
    q_ptr, qpos_ptr, last_ptr, start_ptr, rows_ptr, k_ptr, table_ptr, work_ptr,
    lse_ptr, split_lse_ptr,
    q_stride_b, q_stride_r, q_stride_h, q_stride_d,
    qpos_stride_b, qpos_stride_r,
    k_stride_slot, k_stride_h, k_stride_d,
    table_stride_b,
    num_rows, num_heads, num_slots, first_item, items_start, tiles_per_split,
    uniform_splits, uniform_granules, max_context_len,
    scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, GRANULE: tl.constexpr,
    GRANULE_PAD: tl.constexpr, GRANULES_PER_TILE: tl.constexpr, PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, WORK_LIST: tl.constexpr,
):
    """Per (work item, KV head): the base-2 log-sum-exp of each granule of
    the item's tiles, for every query row x query head of the KV head, and
    of all of them (the item's split sum, which the normaliser combines).

    ``WORK_LIST``: the item is ``work[items_start + 2 * item]`` (scored row,
    first tile; ``retrieval/kernels/scoring_work.py``), the row's query rows are batch
    row ``rows[scored]``'s last ``num_rows`` tokens of ``q`` (``[tokens,
    heads, dim]``) at ``positions`` (padding before the row's first query
    token), its table is the batch's. Else every row has
    ``uniform_splits`` items and ``uniform_granules`` granules and its
    queries are ``q[row]`` at ``query_positions[row]``."""
    item = first_item + tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    # Stacked rows of one tl.dot: query row r x query head kv_head * GROUP + g.
    m = tl.arange(0, BLOCK_M)
    query_row = m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = query_row < num_rows
    if WORK_LIST:
        entry = work_ptr + items_start + 2 * item
        scored = tl.load(entry)
        first_tile = tl.load(entry + 1)
        granule_base = tl.load(work_ptr + 4 * scored)
        num_granules = tl.load(work_ptr + 4 * scored + 1)
        row = tl.load(rows_ptr + scored).to(tl.int64)
        token = tl.load(last_ptr + row).to(tl.int64) - query_row  # the last first
        query_ok = row_ok & (token >= tl.load(start_ptr + row))
        query = tl.maximum(token, 0)
        context_limit = num_granules * GRANULE
    else:
        scored = item // uniform_splits
        first_tile = (item % uniform_splits) * tiles_per_split
        granule_base = scored * uniform_granules
        num_granules = uniform_granules
        row = scored
        query = query_row.to(tl.int64)
        query_ok = row_ok
        context_limit = max_context_len
    qpos = tl.load(qpos_ptr + row * qpos_stride_b + query * qpos_stride_r,
                   mask=query_ok, other=-1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * q_stride_b + query[:, None] * q_stride_r
                + head[:, None] * q_stride_h + d[None, :] * q_stride_d,
                mask=query_ok[:, None] & d_ok[None, :], other=0.0)
    # DOT_IN_FP32: the interpreter multiplies bf16 as raw 16-bit integers
    # (triton 3.9); bf16 products are exact in float32, so the sums agree.
    dot_dtype = tl.float32 if DOT_IN_FP32 else k_ptr.dtype.element_ty
    q = q.to(dot_dtype)
    last_visible = tl.minimum(tl.max(qpos, axis=0), context_limit - 1)

    TILE: tl.constexpr = GRANULES_PER_TILE * GRANULE_PAD
    TILE_SPAN: tl.constexpr = GRANULES_PER_TILE * GRANULE  # positions a tile covers
    t = tl.arange(0, TILE)
    local_granule = t // GRANULE_PAD
    within = t % GRANULE_PAD
    g = tl.arange(0, GRANULES_PER_TILE)
    table_row = table_ptr + row * table_stride_b
    heads_rows = num_rows * num_heads
    stacked = query_row * num_heads + head
    out_rows = lse_ptr + granule_base * heads_rows + stacked.to(tl.int64) * num_granules
    store_ok = row_ok[:, None]
    # Tiles holding a visible position are scored (keys past the row's last
    # visible position are never loaded); the rest only get -inf.
    tiles = (num_granules + GRANULES_PER_TILE - 1) // GRANULES_PER_TILE
    end_tile = tl.minimum(first_tile + tiles_per_split, tiles).to(tl.int32)
    live_tiles = (last_visible + TILE_SPAN) // TILE_SPAN
    live_end = tl.minimum(end_tile, tl.maximum(live_tiles, first_tile)).to(tl.int32)
    split_peak = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    split_total = tl.zeros((BLOCK_M,), tl.float32)
    for tile in tl.range(first_tile.to(tl.int32), live_end, num_stages=3):
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
        new_peak = tl.maximum(split_peak, tl.max(lse, axis=1))
        safe = tl.where(new_peak == -float("inf"), 0.0, new_peak)
        split_total = (split_total * tl.exp2(split_peak - safe)
                       + tl.sum(tl.exp2(lse - safe[:, None]), axis=1))
        split_peak = new_peak
    for tile in range(live_end, end_tile):
        granule = tile * GRANULES_PER_TILE + g
        tl.store(out_rows[:, None] + granule[None, :],
                 tl.full((BLOCK_M, GRANULES_PER_TILE), -float("inf"), tl.float32),
                 mask=store_ok & (granule < num_granules)[None, :])
    split = tl.where(split_total > 0.0, split_peak + tl.log2(tl.maximum(split_total, 1e-30)),
                     -float("inf"))
    tl.store(split_lse_ptr + item * heads_rows + stacked, split, mask=row_ok)


def chunk_scores_kernel(
    lse_ptr, split_lse_ptr, work_ptr, rows_ptr, seq_lens_ptr, slots_ptr, out_ptr,
    heads_rows, first_row, out_stride, out_chunks, chunk_size, uniform_splits,
    uniform_granules,
    GRANULES_PER_CHUNK: tl.constexpr, BLOCK_RH: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr, WORK_LIST: tl.constexpr, OUTPUT: tl.constexpr,
):
    """Per (scored row, block of chunks): the softmax normalisers of the
    row's query rows x heads (combined from its items' split sums), then
    each chunk's probability mass summed over them and the chunk's
    granules. ``OUTPUT``: 0 writes the sums to ``out[row]``, 1 the means
    per context token to ``out[slots[row]]``, 2 adds the means there; 0 and
    1 zero the rest of the output row (``out_chunks`` wide)."""
    scored = first_row + tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    c = block * BLOCK_C + tl.arange(0, BLOCK_C)
    if WORK_LIST:
        info = work_ptr + 4 * scored
        granule_base = tl.load(info)
        num_granules = tl.load(info + 1)
        first_item = tl.load(info + 2).to(tl.int32)
        end_item = tl.load(info + 3).to(tl.int32)
    else:
        granule_base = scored * uniform_granules
        num_granules = uniform_granules
        first_item = (scored * uniform_splits).to(tl.int32)
        end_item = first_item + uniform_splits
    width = tl.minimum((num_granules + GRANULES_PER_CHUNK - 1) // GRANULES_PER_CHUNK, out_chunks)
    acc = tl.zeros((BLOCK_C,), tl.float32)
    if block * BLOCK_C < width:  # blocks past the row only write their zeros
        s = tl.arange(0, BLOCK_S)
        for rh_start in range(0, heads_rows, BLOCK_RH):
            rh = rh_start + tl.arange(0, BLOCK_RH)
            rh_ok = rh < heads_rows
            peak = tl.full((BLOCK_RH,), -float("inf"), tl.float32)
            total = tl.zeros((BLOCK_RH,), tl.float32)
            for item in range(first_item, end_item, BLOCK_S):
                items = item + s
                split = tl.load(split_lse_ptr + items[None, :].to(tl.int64) * heads_rows
                                + rh[:, None],
                                mask=rh_ok[:, None] & (items < end_item)[None, :],
                                other=-float("inf"))
                new_peak = tl.maximum(peak, tl.max(split, axis=1))
                safe = tl.where(new_peak == -float("inf"), 0.0, new_peak)
                total = total * tl.exp2(peak - safe) + tl.sum(tl.exp2(split - safe[:, None]),
                                                              axis=1)
                peak = new_peak
            # +inf where nothing is visible (padding rows): their weights are 0.
            norm = tl.where(total > 0.0, peak + tl.log2(tl.maximum(total, 1e-30)), float("inf"))
            base = lse_ptr + granule_base * heads_rows + rh.to(tl.int64) * num_granules
            for j in range(GRANULES_PER_CHUNK):
                g = c * GRANULES_PER_CHUNK + j
                lse = tl.load(base[:, None] + g[None, :],
                              mask=rh_ok[:, None] & (g < num_granules)[None, :],
                              other=-float("inf"))
                acc += tl.sum(tl.exp2(lse - norm[:, None]), axis=0)
    in_width = c < width
    if OUTPUT == 0:
        target = out_ptr + scored * out_stride + c
        value = acc
    else:
        context = tl.load(seq_lens_ptr + tl.load(rows_ptr + scored)).to(tl.int64)
        count = tl.minimum(tl.maximum(context - c.to(tl.int64) * chunk_size, 0), chunk_size)
        value = acc / tl.maximum(count, 1).to(tl.float32)
        target = out_ptr + tl.load(slots_ptr + scored).to(tl.int64) * out_stride + c
    if OUTPUT == 2:
        tl.store(target, tl.load(target, mask=in_width, other=0.0) + value, mask=in_width)
    else:
        tl.store(target, tl.where(in_width, value, 0.0), mask=c < out_chunks)


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
