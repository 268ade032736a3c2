"""Where the tokens a draft must catch up go in its first pass.

When a draft's forward was skipped (goodput control's free pauses), each
request's next first pass processes, before its query, the tokens verified
meanwhile: request ``r``'s gap is positions ``starts[r] .. starts[r] + gaps[r]``.
Pure numpy on host lengths: the device only gathers with the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
                         starts[gap_rows] + in_row[is_gap])
