"""The planner's chunk scores per request slot: for cmr, each retrieving
row's scores from the target's last-layer attention (at its last token, or
summed over the tokens it accepted), kept per request slot until its next
retrieval.

:class:`ChunkScoring` is a base of
:class:`~vllm_specextend.retrieval.planner.RetrievalPlanner`, which sets the
attributes annotated below. On the scoring kernels (``ScoringWorkspace.use_kernel``,
CUDA) a step's scores, means and store are two launches over a work list
built from the rows' lengths on the host (``retrieval/kernels/scoring_triton.py``,
``retrieval/kernels/scoring_work.py``); the torch ops here are the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.retrieval.kernels.scoring import (
    ScoringWorkspace,
    chunk_attention_sums,
    chunk_token_counts,
)
from vllm_specextend.retrieval.kernels.scoring_triton import (
    score_rows_triton,
    stage_work,
    store_chunk_means,
)
from vllm_specextend.retrieval.kernels.scoring_work import WorkLists
from vllm_specextend.retrieval.request_rows import StagedRows, StepRows
from vllm_specextend.retrieval.target_tap import TargetAttentionTap


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
    _work_lists: WorkLists
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
            step.seq_lens[score_rows],
            accumulate=accumulate,
        )

    def _accumulate_scores(
        self,
        rows_t: torch.Tensor,
        slots: torch.Tensor,
        batch: PlanningBatch,
        seq_lens: np.ndarray,
        accumulate: bool,
    ) -> None:
        """Chunk scores of the given batch rows (``seq_lens``: their lengths,
        host int64), added to (``accumulate``: scored from their ``K + 1``
        query rows) or written over (from their last token) their slots'
        scores."""
        assert self._score_sums is not None and self.scoring_workspace is not None
        num_query_rows = self.max_num_speculative_tokens + 1 if accumulate else 1
        if self.scoring_workspace.use_kernel:
            if self._sum_over_ranks is None:
                # Scores, means and the store in two launches, for ~12 torch ops.
                self._score_on_kernels(rows_t, batch, seq_lens, num_query_rows,
                                       out=self._score_sums, slots=slots, accumulate=accumulate)
                return
            sums = self._chunk_sums(rows_t, batch, seq_lens, num_query_rows)
            store_chunk_means(sums, rows_t, batch.seq_lens, slots, self._score_sums,
                              self.chunk_size, accumulate)
            return
        scores = self._chunk_scores(rows_t, batch, seq_lens, num_query_rows)
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
        seq_lens: np.ndarray,
        num_query_rows: int,
    ) -> torch.Tensor:
        """Mean attention per token of each chunk, from the target's last
        layer, for the last ``num_query_rows`` tokens of the given rows
        (``seq_lens``: their lengths, host int64)."""
        sums = self._chunk_sums(rows_t, batch, seq_lens, num_query_rows)
        counts = chunk_token_counts(batch.seq_lens[rows_t], sums.shape[1], self.chunk_size)
        return sums / counts.clamp(min=1)

    def _chunk_sums(
        self,
        rows_t: torch.Tensor,
        batch: PlanningBatch,
        seq_lens: np.ndarray,
        num_query_rows: int,
    ) -> torch.Tensor:
        """:func:`chunk_attention_sums` of the given rows, over all ranks."""
        tap, workspace = self.tap, self.scoring_workspace
        assert tap is not None and workspace is not None
        if workspace.use_kernel:
            sums = self._score_on_kernels(rows_t, batch, seq_lens, num_query_rows)
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
                queries, query_positions, tap.keys, tables, int(seq_lens.max()), tap.scale,
                self.block_size, self.chunk_size, workspace,
            )
        return sums if self._sum_over_ranks is None else self._sum_over_ranks(sums)

    def _score_on_kernels(self, rows_t: torch.Tensor, batch: PlanningBatch, seq_lens: np.ndarray,
                          num_query_rows: int, **output) -> torch.Tensor:
        """:func:`score_rows_triton` over a work list staged for ``seq_lens``
        (the query rows read from the tap by each row's last token)."""
        tap, workspace = self.tap, self.scoring_workspace
        assert tap is not None and workspace is not None
        work = stage_work(self._work_lists, seq_lens, num_query_rows, self.chunk_size, workspace)
        return score_rows_triton(
            work, rows_t, tap.queries, batch.positions, batch.last_token_indices,
            batch.query_start_loc, batch.seq_lens, batch.block_table, tap.keys, num_query_rows,
            tap.scale, self.block_size, self.chunk_size, workspace, **output)
