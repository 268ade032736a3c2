"""One verification step of the target as a drafter adapter hands it to both
features (retrieval plans from it, goodput control decides from it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PlanningBatch:
    """One verification step of the target, as the planner needs it.

    Device tensors are indexed by batch row; CPU arrays hold what the runner
    already knows on the host (no device reads).
    """

    req_ids: list[str]
    query_start_loc: torch.Tensor
    """``[num_reqs + 1]``, device: flat start of each row's query."""
    seq_lens: torch.Tensor
    """``[num_rows]``, device: context length including this step's query;
    rows past ``num_reqs`` are the runner's padding."""
    block_table: torch.Tensor
    """``[num_rows, max_blocks]``, device: the shared (target and draft) block table."""
    last_token_indices: torch.Tensor
    """``[num_reqs]``, device: flat index of each row's last accepted token."""
    positions: torch.Tensor
    """``[num_tokens]``, device: the target's positions of the flat tokens."""
    query_lens_cpu: np.ndarray
    """``[num_reqs]``: tokens scheduled for each row in this step."""
    context_lens_cpu: np.ndarray
    """``[num_reqs]``: tokens before each row's query (an upper bound is fine)."""
    prompt_lens_cpu: np.ndarray
    """``[num_reqs]``: prompt length of each request."""
    draft_query_start_loc: torch.Tensor | None = None
    """``[num_reqs + 1]``, device: each row's query as the draft's first pass
    runs it, where that differs from ``query_start_loc``: goodput control's
    catch-up puts the tokens a paused draft skipped before a row's query.
    A row's recent window is kept before this query (None: the target's)."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)
