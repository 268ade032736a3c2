"""The planner's data types: what a runner hands it for one verification step
(:class:`PlanningBatch`), what it answers (:class:`DraftView`, with the
working caches to re-position, :class:`WorkingCacheRewrite`), and the
private layout areas kept out of the scheduler's pool
(:class:`PrivateLayouts`)."""

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


@dataclass
class WorkingCacheRewrite:
    """Rows whose kept context moved and must be laid out at positions 0, 1, ..."""

    rows: torch.Tensor
    max_context_len: int


@dataclass
class DraftView:
    """What the draft's attention sees during one proposal."""

    block_table: torch.Tensor
    removed_tokens: torch.Tensor
    kept_context_lens: torch.Tensor
    """``[num_reqs]``: context before the query that the draft still sees."""
    rewrites: list[WorkingCacheRewrite]
    """Compact positions only: working caches to re-position before drafting."""
    kept_block_table: torch.Tensor | None = None
    """With private layouts: ``block_table`` before its leading context blocks
    were swapped for the request's private blocks (where the re-positioned
    KV is read from); None: the same as ``block_table``."""


@dataclass(frozen=True)
class PrivateLayouts:
    """Blocks kept out of the scheduler's pool: ``areas`` areas of
    ``blocks_per_area`` blocks from ``first_block`` on, one per request that
    has one, holding its re-positioned working cache."""

    first_block: int
    areas: int
    blocks_per_area: int
