"""Where the tokens a draft must catch up go in its first pass.

When a draft's forward was skipped (goodput control's free pauses), each
request's next first pass processes, before its query, the tokens verified
meanwhile: request ``r``'s gap is positions ``starts[r] .. starts[r] + gaps[r]``.
Pure numpy on host lengths: the device only gathers with the result.

An EAGLE head's first pass also takes the target's hidden state of every
token: :func:`ring_rows` indexes the buffer that keeps the recent ones,
and :func:`gap_slot_mapping` gives the gap tokens their KV slots (a head
writes through the target's slot mapping, which has none for them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CatchUpLayout:
    query_start_loc: np.ndarray
    """``[rows + 1]``: query starts of the first pass, gaps included."""
    order: np.ndarray
    """Per first-pass token, its index in ``concat(query tokens, gap tokens)``."""
    gap_rows: np.ndarray
    """Per gap token (in gap order), its row."""
    gap_positions: np.ndarray
    """Per gap token, its position in its request."""
    row_shift: np.ndarray
    """``[rows]``: how far each row's query tokens move (its gap and those of
    the rows before it): a query token's index in the first pass is its old
    index plus its row's shift."""


@dataclass(frozen=True)
class CatchUp:
    """A step's catch-up as the adapter puts it into its first pass: the
    layout on the host, and what the device reads, staged."""

    layout: CatchUpLayout
    num_rows: int
    num_tokens: int
    """Query tokens of the step before the gaps go in."""
    order: torch.Tensor
    """``layout.order`` on the device."""
    gap_positions: torch.Tensor
    """Per gap token, its position (device)."""
    gap_ids: torch.Tensor
    """Per gap token, its token id (device)."""
    gap_rows: torch.Tensor
    """Per gap token, its row (device)."""
    row_shift: torch.Tensor
    """``layout.row_shift`` on the device."""
    gap_hidden: torch.Tensor | None
    """A head's kept target hidden states of the gap tokens (None: a draft
    model)."""
    stage: Callable[[np.ndarray], torch.Tensor]
    """The step's staging, for what the adapter builds from the layout."""


def catch_up_layout(query_lens: np.ndarray, starts: np.ndarray,
                    gaps: np.ndarray) -> CatchUpLayout:
    """Each row's gap tokens, then its query tokens (``query_lens`` of them,
    in the order of the flat query)."""
    num_rows = len(query_lens)
    new_lens = query_lens + gaps
    query_start_loc = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(new_lens, out=query_start_loc[1:])
    gap_start = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(gaps, out=gap_start[1:])
    old_query_start = query_start_loc - gap_start
    num_query_tokens = int(query_lens.sum())
    rows = np.repeat(np.arange(num_rows), new_lens)
    in_row = np.arange(int(query_start_loc[-1])) - query_start_loc[rows]
    is_gap = in_row < gaps[rows]
    order = np.where(is_gap, num_query_tokens + gap_start[rows] + in_row,
                     old_query_start[rows] + in_row - gaps[rows])
    gap_rows = rows[is_gap]
    return CatchUpLayout(query_start_loc, order, gap_rows,
                         starts[gap_rows] + in_row[is_gap], gap_start[1:])


def ring_rows(slots: np.ndarray | torch.Tensor, positions: np.ndarray | torch.Tensor,
              capacity: int):
    """Row of a ``[requests x capacity]`` ring (flattened) holding each
    token's entry: request slot ``slots[i]``, position ``positions[i]``."""
    return slots * capacity + positions % capacity


def gap_slot_mapping(block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """The KV slot of each gap token (row ``rows[i]`` of ``block_table``,
    position ``positions[i]``): what vLLM's slot mapping would give it."""
    blocks = block_table[rows, torch.div(positions, block_size, rounding_mode="floor")]
    return blocks.long() * block_size + positions % block_size
