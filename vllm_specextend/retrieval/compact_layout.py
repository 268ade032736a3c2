"""Compact positions: how the planner lays out a windowed prompt chunk (the
sink and the recent blocks that fit the draft's window, StreamingLLM; with
cmr, the chunk that ends the prompt also attends to the target's top-k
chunks), and, with private layouts, which leading blocks of a re-positioned
working cache are read from the request's own area.

:class:`CompactLayout` is a base of
:class:`~vllm_specextend.retrieval.planner.RetrievalPlanner`, which sets the
attributes annotated below and provides ``_sink_blocks`` and ``_num_blocks``
(``_rows``, the per-slot state with each request's area, comes from
:class:`~vllm_specextend.retrieval.request_rows.RequestRows`, ``_chunk_scores``
from :class:`~vllm_specextend.retrieval.chunk_scoring.ChunkScoring`).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.common.staging import IndexStager
from vllm_specextend.retrieval.draft_view import PrivateLayouts, WorkingCacheRewrite
from vllm_specextend.retrieval.kernels.selection import select_blocks
from vllm_specextend.retrieval.repositioning import streaming_recent_start_block
from vllm_specextend.retrieval.request_rows import StepRows
from vllm_specextend.retrieval.row_kernels import RetrievalRowState


class CompactLayout:
    """Windowed prompt-chunk layouts and private-layout block swaps."""

    config: SpecExtendConfig
    device: torch.device
    block_size: int
    chunk_size: int
    draft_window: int
    max_num_speculative_tokens: int
    use_kernels: bool
    private_layouts: PrivateLayouts | None
    _index_stager: IndexStager
    _rows: RetrievalRowState
    _private_blocks: torch.Tensor

    def _swap_in_private_blocks(
        self,
        batch: PlanningBatch,
        step: StepRows,
        compact: torch.Tensor,
        kept_context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Private layouts: the whole context blocks of each re-positioned
        working cache are read from the request's own area (the rewrite
        writes them there); the block holding the query start and later
        ones, which only this request writes, stay in place."""
        layouts = self.private_layouts
        assert layouts is not None
        private_slots = step.slots[step.private_rows]
        rows = self._index_stager(step.private_rows)
        slots = self._index_stager(private_slots)
        first_blocks = self._index_stager(
            layouts.first_block + self._rows.area_of_slot[private_slots] * layouts.blocks_per_area)
        laid_out = np.concatenate((step.due_rows, step.windowed_prefill_rows))
        rewritten = self._index_stager(np.isin(step.private_rows, laid_out))
        context_blocks = (kept_context_lens[rows] // self.block_size).clamp(
            max=layouts.blocks_per_area)
        self._private_blocks[slots] = torch.where(
            rewritten.bool(), context_blocks, self._private_blocks[slots])
        width = min(layouts.blocks_per_area, compact.shape[1])
        index = torch.arange(width, device=self.device)
        private = index.view(1, -1) < self._private_blocks[slots].view(-1, 1)
        swapped = compact.clone()
        swapped[rows, :width] = torch.where(
            private, (first_blocks.view(-1, 1) + index).to(compact.dtype), compact[rows, :width])
        return swapped
    def _lay_out_windowed_prefill(
        self,
        batch: PlanningBatch,
        step: StepRows,
        keep: torch.Tensor,
        first_query_pos: torch.Tensor,
        query_lens: torch.Tensor,
    ) -> list[WorkingCacheRewrite]:
        """Compact positions: a prompt chunk beyond the draft's window attends
        to the sink and as many recent blocks as fit (StreamingLLM); with cmr,
        the chunk that ends the prompt also attends to the top-k chunks of
        the target's attention from the prompt's last token."""
        assert step.seq_lens is not None
        streaming_rows = step.windowed_prefill_rows[
            ~np.isin(step.windowed_prefill_rows, step.last_prompt_chunk_rows)]
        if streaming_rows.size:
            self._lay_out_prefill_rows(batch, streaming_rows, step.seq_lens, keep,
                                       first_query_pos, query_lens, top_k_chunks=0)
        if step.last_prompt_chunk_rows.size:
            self._lay_out_prefill_rows(
                batch, step.last_prompt_chunk_rows, step.seq_lens, keep, first_query_pos,
                query_lens, top_k_chunks=self._top_k_chunks_beside_prompt_chunk(
                    int(batch.query_lens_cpu[step.last_prompt_chunk_rows].max())),
            )
        rows = self._index_stager(step.windowed_prefill_rows)
        return [WorkingCacheRewrite(rows, self.draft_window)]

    def _top_k_chunks_beside_prompt_chunk(self, query_len: int) -> int:
        """Retrieved chunks that fit in the draft's window beside the sink,
        a prompt chunk of ``query_len`` tokens and the draft lookahead."""
        free = (self.draft_window - self._sink_blocks * self.block_size - query_len
                - self.max_num_speculative_tokens - (self.block_size - 1))
        top_k = self.config.resolved_top_k_chunks(self.chunk_size)
        return max(0, min(top_k, free // self.chunk_size))

    def _lay_out_prefill_rows(
        self,
        batch: PlanningBatch,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        keep: torch.Tensor,
        first_query_pos: torch.Tensor,
        query_lens: torch.Tensor,
        top_k_chunks: int,
    ) -> None:
        """Keep the sink, ``top_k_chunks`` chunks scored by the target from
        each row's last token, and the recent blocks that fit the window."""
        rows_t = self._index_stager(rows)
        if top_k_chunks > 0:
            scores = self._chunk_scores(rows_t, batch, seq_lens[rows],
                                        num_query_rows=1)
        else:
            scores = torch.empty(len(rows), 0, device=self.device)
        recent_start_block = streaming_recent_start_block(
            first_query_pos[rows_t], query_lens[rows_t], self.max_num_speculative_tokens,
            self._sink_blocks, self.draft_window - top_k_chunks * self.chunk_size,
            self.block_size,
        )
        num_blocks = self._num_blocks(batch)
        keep[rows_t, :num_blocks] = select_blocks(
            scores,
            recent_start_block,
            top_k_chunks=top_k_chunks,
            sink_blocks=self._sink_blocks,
            blocks_per_chunk=self.chunk_size // self.block_size,
            num_blocks=num_blocks,
            use_kernel=self.use_kernels,
        )
