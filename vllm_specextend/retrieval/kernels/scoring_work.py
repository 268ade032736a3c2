"""The scoring kernel's work list, built on the host from the rows' context
lengths (the host knows them: no device read), so that the kernel's grid is
the work there is, not rows x the longest row.

A batch's rows are cut into items of at most ``tiles_per_split`` tiles of
keys; one program per item and KV head reads them. ``tiles_per_split`` is
the power of two (at least :data:`MIN_SPLIT_TILES`) that gives about
:data:`TARGET_PROGRAMS` programs for the whole batch, so a 128K row in a
batch of short rows is read by as many programs as its length asks for.
The items then number at most ``TARGET_PROGRAMS / kv_heads + rows``
(:func:`max_work_items`), whatever the lengths: the list and the kernel's
per-item buffer are allocated once.

The list, int64, as the kernels read it (``retrieval/kernels/_scoring_triton_kernels.py``):

- per scored row ``i`` (``4 * i``): its granule sums' first granule in the
  workspace, its granules, its first item and its end item;
- per item ``j`` (from ``4 * rows``, ``2 * j``): its row and first tile.

Every entry is a pair of int64s, so a list staged at a 16-byte boundary
keeps its items there. Rows whose granule sums exceed the workspace are
scored in groups (each group's granules start at 0); a batch within the
workspace is one group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specextend.common.compiled import compiled
from vllm_specextend.common.staging import host_staging_buffer

TARGET_PROGRAMS = 2048
"""Programs the scoring launch aims for (items x KV heads)."""
MIN_SPLIT_TILES = 4
"""Tiles per item at least (fewer would spend more time on Q loads than keys)."""
ROW_ENTRIES, ITEM_ENTRIES = 4, 2


def max_work_items(max_rows: int, num_kv_heads: int) -> int:
    """Items a batch of ``max_rows`` rows can have: each row's items but its
    last are full, and the full ones are at most TARGET_PROGRAMS / kv_heads."""
    return -(-TARGET_PROGRAMS // num_kv_heads) + max_rows


def max_work_list_len(max_rows: int, num_kv_heads: int = 1) -> int:
    """Entries of the longest list (even: lists stay 16-byte aligned)."""
    return ROW_ENTRIES * max_rows + ITEM_ENTRIES * max_work_items(max_rows, num_kv_heads)


@compiled
def build_work_list(seq_lens, granule, granules_per_tile, num_kv_heads, budget_granules,
                    work, groups):
    """Writes the list for rows of ``seq_lens`` tokens into ``work`` and
    the row groups ``(first row, end row, first item, end item)`` into
    ``groups``. Returns ``(list length, tiles per split, groups, longest
    row)``; groups = -1 when one row alone has more granules than
    ``budget_granules``."""
    rows = seq_lens.shape[0]
    total_tiles = longest = 0
    for i in range(rows):
        granules = (seq_lens[i] + granule - 1) // granule
        total_tiles += (granules + granules_per_tile - 1) // granules_per_tile
        longest = max(longest, seq_lens[i])
    wanted = (total_tiles * num_kv_heads + TARGET_PROGRAMS - 1) // TARGET_PROGRAMS
    tiles_per_split = MIN_SPLIT_TILES
    while tiles_per_split < wanted:
        tiles_per_split *= 2
    items_start = ROW_ENTRIES * rows
    item = base = num_groups = first_row = first_item = 0
    for i in range(rows):
        granules = (seq_lens[i] + granule - 1) // granule
        if granules > budget_granules:
            return 0, tiles_per_split, -1, longest
        if base + granules > budget_granules:
            groups[num_groups, 0], groups[num_groups, 1] = first_row, i
            groups[num_groups, 2], groups[num_groups, 3] = first_item, item
            num_groups += 1
            first_row, first_item, base = i, item, 0
        tiles = (granules + granules_per_tile - 1) // granules_per_tile
        splits = (tiles + tiles_per_split - 1) // tiles_per_split
        entry = ROW_ENTRIES * i
        work[entry], work[entry + 1] = base, granules
        work[entry + 2], work[entry + 3] = item, item + splits
        for split in range(splits):
            entry = items_start + ITEM_ENTRIES * item
            work[entry], work[entry + 1] = i, split * tiles_per_split
            item += 1
        base += granules
    groups[num_groups, 0], groups[num_groups, 1] = first_row, rows
    groups[num_groups, 2], groups[num_groups, 3] = first_item, item
    return items_start + ITEM_ENTRIES * item, tiles_per_split, num_groups + 1, longest


@dataclass
class StagedWork:
    """One staged work list: the device list and what the launches need."""

    work: torch.Tensor
    groups: list[tuple[int, int, int, int]]
    """(first row, end row, first item, end item) per launch pair."""
    tiles_per_split: int
    items_start: int
    """Where the items begin in ``work`` (4 x rows)."""
    num_rows: int
    max_chunks: int
    """Chunks of the longest row."""


class WorkLists:
    """Builds and stages the scoring kernel's work lists: built straight
    into page-locked staging rows (``common/staging.py``), then one
    ``non_blocking`` copy each into device rows, all allocated once for
    ``max_rows`` rows. ``depth`` sets of rows rotate between steps (as
    :class:`~vllm_specextend.common.staging.IndexStager`'s), each holding two
    lists (the decode rows' and the windowed prompt chunks'). Every list
    starts a multiple of 16 bytes into the buffer (lists have even lengths),
    so Triton, which specialises pointers on 16-byte alignment, never sees
    another alignment (which would compile the kernel anew mid-serving)."""

    LISTS_PER_STEP = 2

    def __init__(self, max_rows: int, device: torch.device, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"WorkLists depth must be >= 2, got {depth}")
        # Sized for one KV head, the most items a batch can have.
        self._capacity = max_work_list_len(max_rows)
        shape = (depth, self.LISTS_PER_STEP * self._capacity)
        self._on_host = device.type == "cpu"
        self._host = (torch.zeros(shape, dtype=torch.int64) if self._on_host
                      else host_staging_buffer(shape, torch.int64))
        self._host_np = self._host.numpy()
        self._device = self._host if self._on_host else torch.zeros(shape, dtype=torch.int64,
                                                                   device=device)
        self._groups = np.zeros((max_rows, 4), dtype=np.int64)
        self._set = self._end = self._lists = 0
        build_work_list(np.ones(1, dtype=np.int64), 1, 1, 1, 1, self._host_np[0], self._groups)

    def next_step(self) -> None:
        self._set = (self._set + 1) % self._host_np.shape[0]
        self._end = self._lists = 0

    def stage(self, seq_lens: np.ndarray, chunk_size: int, granule: int, granules_per_tile: int,
              num_kv_heads: int, budget_granules: int) -> StagedWork:
        """The list for rows of ``seq_lens`` tokens (int64, host), staged
        (valid until this set of rows comes round again)."""
        if self._lists == self.LISTS_PER_STEP:
            raise RuntimeError(f"more than {self.LISTS_PER_STEP} work lists staged in one step")
        if len(seq_lens) > len(self._groups):
            raise ValueError(f"{len(seq_lens)} rows scored, work lists sized for "
                             f"{len(self._groups)}")
        start = self._end
        length, tiles_per_split, num_groups, longest = build_work_list(
            seq_lens, granule, granules_per_tile, num_kv_heads, budget_granules,
            self._host_np[self._set, start:], self._groups)
        if num_groups < 0:
            raise ValueError(
                f"scoring workspace holds {budget_granules} granules per query row and head, a "
                f"row of {longest} tokens needs more: allocate ScoringWorkspace with "
                f"max_context_len >= {longest}")
        self._lists += 1
        self._end = start + length  # even: the next list stays aligned
        work = self._device[self._set, start : start + length]
        if not self._on_host:
            work.copy_(self._host[self._set, start : start + length], non_blocking=True)
        groups = [tuple(group) for group in self._groups[:num_groups].tolist()]
        return StagedWork(work, groups, tiles_per_split, ROW_ENTRIES * len(seq_lens),
                          len(seq_lens), -(-longest // chunk_size))
