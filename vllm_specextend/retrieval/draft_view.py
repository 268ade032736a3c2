"""The planner's data types: what it answers for a step's
:class:`~vllm_specextend.common.planning_batch.PlanningBatch` (:class:`DraftView`, with the
working caches to re-position, :class:`WorkingCacheRewrite`), and the
private layout areas kept out of the scheduler's pool
(:class:`PrivateLayouts`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
