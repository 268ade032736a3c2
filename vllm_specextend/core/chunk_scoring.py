"""The planner's chunk scores per request slot: for cmr, each retrieving
row's scores from the target's last-layer attention (at its last token, or
summed over the tokens it accepted), kept per request slot until its next
retrieval.

:class:`ChunkScoring` is a base of
:class:`~vllm_specextend.core.planner.RetrievalPlanner`, which sets the
attributes annotated below. On the scoring kernel (``ScoringWorkspace.use_kernel``,
CUDA) the query rows are gathered and the means stored by one launch each
(``core/scoring_triton.py``); the torch ops here are the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_specextend.core.draft_view import PlanningBatch
from vllm_specextend.core.options import SpecExtendConfig
from vllm_specextend.core.request_rows import StagedRows, StepRows
from vllm_specextend.core.scoring import (
    ScoringWorkspace,
    chunk_attention_sums,
    chunk_token_counts,
)
from vllm_specextend.core.scoring_triton import gather_query_rows, store_chunk_means
from vllm_specextend.core.target_tap import TargetAttentionTap


class ChunkScoring:
    """Chunk scores of the retrieving rows, per request slot."""

    config: SpecExtendConfig
    device: torch.device
    block_size: int
    chunk_size: int
    max_num_speculative_tokens: int
    tap: TargetAttentionTap | None
    scoring_workspace: ScoringWorkspace | None
    _score_sums: torch.Tensor | None
    _sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None

    def _drop_scores(self, slot: int) -> None:
        """A request stops being tracked: with ``accepted_tokens`` its sums
        since its last retrieval must not pass to the next request in its
        slot (a fill of one row: no host value reaches the device)."""
        if self._score_sums is not None and self.config.score_aggregation == "accepted_tokens":
            self._score_sums[slot].zero_()

    def _score(self, batch: PlanningBatch, step: StepRows, staged: StagedRows) -> None:
        """cmr: chunk scores from the target's last layer, for the rows due
        (``last_token``) or every retrieval row (``accepted_tokens``)."""
        accumulate = self.config.score_aggregation == "accepted_tokens"
        score_rows = step.retrieval_rows if accumulate else step.due_rows
        if not score_rows.size:
            return
        assert step.seq_lens is not None
        self._accumulate_scores(
            staged.rows if accumulate else staged.due,
            staged.slots if accumulate else staged.due_slots,
            batch,
            int(step.seq_lens[score_rows].max()),
            accumulate=accumulate,
        )

    def _accumulate_scores(
        self,
        rows_t: torch.Tensor,
        slots: torch.Tensor,
        batch: PlanningBatch,
        max_context_len: int,
        accumulate: bool,
    ) -> None:
        """Chunk scores of the given batch rows, added to (``accumulate``:
        scored from their ``K + 1`` query rows) or written over (from their
        last token) their slots' scores."""
        assert self._score_sums is not None and self.scoring_workspace is not None
        num_query_rows = self.max_num_speculative_tokens + 1 if accumulate else 1
        if self.scoring_workspace.use_kernel:
            # The mean and the store in one launch, for the ~8 ops below.
            sums = self._chunk_sums(rows_t, batch, max_context_len, num_query_rows)
            store_chunk_means(sums, rows_t, batch.seq_lens, slots, self._score_sums,
                              self.chunk_size, accumulate)
            return
        scores = self._chunk_scores(rows_t, batch, max_context_len, num_query_rows)
        width = min(scores.shape[1], self._score_sums.shape[1])
        if accumulate:
            self._score_sums[slots, :width] += scores[:, :width]
        else:
            self._score_sums.index_fill_(0, slots, 0.0)
            self._score_sums[slots, :width] = scores[:, :width]

    def _chunk_scores(
        self,
        rows_t: torch.Tensor,
        batch: PlanningBatch,
        max_context_len: int,
        num_query_rows: int,
    ) -> torch.Tensor:
        """Mean attention per token of each chunk, from the target's last
        layer, for the last ``num_query_rows`` tokens of the given rows."""
        sums = self._chunk_sums(rows_t, batch, max_context_len, num_query_rows)
        counts = chunk_token_counts(batch.seq_lens[rows_t], sums.shape[1], self.chunk_size)
        return sums / counts.clamp(min=1)

    def _chunk_sums(
        self,
        rows_t: torch.Tensor,
        batch: PlanningBatch,
        max_context_len: int,
        num_query_rows: int,
    ) -> torch.Tensor:
        """:func:`chunk_attention_sums` of the given rows, over all ranks."""
        tap, workspace = self.tap, self.scoring_workspace
        assert tap is not None and workspace is not None
        if workspace.use_kernel:
            # One launch for the ~12 ops below.
            queries, query_positions, tables = gather_query_rows(
                rows_t, batch.last_token_indices, batch.query_start_loc, batch.positions,
                tap.queries, batch.block_table, num_query_rows)
        else:
            last = batch.last_token_indices[rows_t].long()
            query_index = last.view(-1, 1) - torch.arange(
                num_query_rows, device=self.device
            ).view(1, -1)
            valid = query_index >= batch.query_start_loc[rows_t].view(-1, 1)
            query_index = query_index.clamp(min=0)
            query_positions = torch.where(valid, batch.positions[query_index], -1)
            queries, tables = tap.queries[query_index], batch.block_table[rows_t]
        sums = chunk_attention_sums(
            queries, query_positions, tap.keys, tables, max_context_len, tap.scale,
            self.block_size, self.chunk_size, workspace,
        )
        return sums if self._sum_over_ranks is None else self._sum_over_ranks(sums)
