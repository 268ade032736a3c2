"""The scoring kernel's work list (``retrieval/kernels/scoring_work.py``), built on the
host from the rows' lengths: every tile of every row in exactly one item,
items in row order, each row's granules where its group's workspace puts
them, at most ``max_work_items`` items (the bound the buffers are allocated
for), on ragged batches: empty rows, a row of one token, a row at the
workspace's limit, long rows beside short ones. The kernels that read the
list are tested in test_scoring_ragged.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specextend.retrieval.kernels.scoring_work import (
    MIN_SPLIT_TILES,
    TARGET_PROGRAMS,
    WorkLists,
    build_work_list,
    max_work_items,
    max_work_list_len,
)

GRANULE, GRANULES_PER_TILE = 32, 2


def build(lengths, num_kv_heads=8, budget=1 << 30):
    seq_lens = np.array(lengths, dtype=np.int64)
    work = np.full(max_work_list_len(len(lengths)), -7, dtype=np.int64)
    groups = np.zeros((max(1, len(lengths)), 4), dtype=np.int64)
    length, tiles_per_split, num_groups, longest = build_work_list(
        seq_lens, GRANULE, GRANULES_PER_TILE, num_kv_heads, budget, work, groups)
    return work[:length], groups[:max(num_groups, 0)], tiles_per_split, num_groups, longest


@pytest.mark.parametrize("lengths", [
    [1], [131072], [1, 131072, 37, 0, 4096], [0, 0], [131072] + [1024] * 63,
    [4096] * 256, list(range(1, 300, 7)),
])
@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_every_tile_is_in_one_item_and_the_items_stay_bounded(lengths, num_kv_heads):
    work, groups, tiles_per_split, num_groups, longest = build(lengths, num_kv_heads)
    rows = len(lengths)
    assert num_groups == 1 and groups.tolist() == [[0, rows, groups[0, 2], groups[0, 3]]]
    assert longest == max(lengths)
    # A power of two, no fewer than the minimum.
    assert tiles_per_split >= MIN_SPLIT_TILES and tiles_per_split & (tiles_per_split - 1) == 0
    info = work[: 4 * rows].reshape(rows, 4)
    items = work[4 * rows:].reshape(-1, 2)
    assert len(items) == groups[0, 3] <= max_work_items(rows, num_kv_heads)
    granule_base = 0
    for row, (base, granules, first_item, end_item) in enumerate(info.tolist()):
        assert base == granule_base and granules == -(-lengths[row] // GRANULE)
        granule_base += granules
        tiles = -(-granules // GRANULES_PER_TILE)
        covered = []
        for scored, first_tile in items[first_item:end_item].tolist():
            assert scored == row
            covered += range(first_tile, min(first_tile + tiles_per_split, tiles))
        assert covered == list(range(tiles)), row
    assert info[-1, 3] == len(items)  # rows' items back to back, in row order
    # Enough programs for the GPU, when the batch has the tiles for them.
    total_tiles = sum(-(-(-(-n // GRANULE)) // GRANULES_PER_TILE) for n in lengths)
    if total_tiles >= MIN_SPLIT_TILES * TARGET_PROGRAMS:
        assert len(items) * num_kv_heads >= TARGET_PROGRAMS // 2


def test_rows_past_the_workspace_are_scored_in_groups():
    lengths = [300, 5, 640, 1, 200, 640]
    budget = 25  # granules: 640 tokens need 20, so no two long rows share a group
    work, groups, _, num_groups, _ = build(lengths, budget=budget)
    assert num_groups == len(groups) >= 3
    info = work[: 4 * len(lengths)].reshape(-1, 4)
    assert groups[0, 0] == 0 and groups[-1, 1] == len(lengths)
    for (first_row, end_row, first_item, end_item), nxt in zip(groups.tolist(),
                                                               [*groups[1:].tolist(), None]):
        assert info[first_row, 0] == 0  # each group's granules start its workspace
        assert info[end_row - 1, 0] + info[end_row - 1, 1] <= budget
        assert info[first_row, 2] == first_item and info[end_row - 1, 3] == end_item
        if nxt is not None:
            assert nxt[0] == end_row and nxt[2] == end_item


def test_a_row_past_the_workspace_is_a_clear_error():
    *_, num_groups, _ = build([64, 2000], budget=40)
    assert num_groups == -1
    lists = WorkLists(2, torch.device("cpu"), depth=2)
    lists.next_step()
    with pytest.raises(ValueError, match="max_context_len >= 2000"):
        lists.stage(np.array([64, 2000]), 32, GRANULE, GRANULES_PER_TILE, 8, 40)


def test_staged_lists_rotate_and_start_on_16_bytes():
    lists = WorkLists(4, torch.device("cpu"), depth=2)
    staged = []
    for step in range(3):
        lists.next_step()
        # Two lists a step (decode rows, windowed prompt chunks), the first of odd length.
        staged.append([lists.stage(np.array(lengths), 32, GRANULE, GRANULES_PER_TILE, 8, 1 << 20)
                       for lengths in ([100, 7, 3000], [50 + step])])
    for first, second in staged:
        assert first.work.data_ptr() % 16 == 0 and second.work.data_ptr() % 16 == 0
        assert first.items_start == 12 and first.max_chunks == 94
    # A list is valid until its set comes round again (depth steps on).
    assert staged[1][1].work[1].item() == 2 and staged[2][1].work[1].item() == 2
    assert staged[0][1].work.data_ptr() == staged[2][1].work.data_ptr()
    with pytest.raises(RuntimeError, match="more than 2 work lists"):
        lists.stage(np.array([1]), 32, GRANULE, GRANULES_PER_TILE, 8, 1 << 20)
