"""Per-step retrieval planning, shared by every drafter and runner.

A runner describes its verification step as a :class:`PlanningBatch`; the
planner answers with the draft's view of the KV cache (:class:`DraftView`):
a compacted block table and the tokens removed per row. It keeps the
per-request state (when each request last retrieved, its chunk scores and
selected blocks) and the retrieval counters. Scoring, selection and
re-positioning are the pure functions next to it in ``core``.

One step, in :meth:`RetrievalPlanner.plan`: classify the rows on the host
(:meth:`~RetrievalPlanner._classify_rows`), stage their indices, score the
context for cmr, retrieve for the rows that are due, lay out windowed
prefills (compact positions), rewrite the block table, and record.

The data types live in ``retrieval/draft_view.py``, the per-request state and the
row classification in ``retrieval/request_rows.py`` (:class:`RequestRows`), the
chunk scores per request slot in ``retrieval/chunk_scoring.py``
(:class:`ChunkScoring`), the windowed prefill layouts and private-layout
swaps in ``retrieval/compact_layout.py`` (:class:`CompactLayout`); the three
classes are bases of :class:`RetrievalPlanner`. On CUDA (``use_kernels``)
a decode step's device work is two index copies and three Triton launches
(``retrieval/kernels/*_triton.py``: scoring over a work list built from the rows'
lengths, chunk scores into the request slots, then selection, rewrite and
record); elsewhere torch ops, the reference the kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.common.staging import IndexStager
from vllm_specextend.retrieval.chunk_scoring import ChunkScoring
from vllm_specextend.retrieval.compact_layout import CompactLayout
from vllm_specextend.retrieval.counters import RetrievalStats
from vllm_specextend.retrieval.draft_view import (
    DraftView,
    PrivateLayouts,
    WorkingCacheRewrite,
)
from vllm_specextend.retrieval.kernels.scoring import ScoringWorkspace
from vllm_specextend.retrieval.kernels.scoring_work import WorkLists
from vllm_specextend.retrieval.kernels.selection import rewrite_block_table, select_blocks
from vllm_specextend.retrieval.kernels.selection_triton import (
    rewrite_rows_and_record,
    select_and_rewrite_decode_rows,
)
from vllm_specextend.retrieval.refresh import REFRESH_CAUSES
from vllm_specextend.retrieval.request_rows import RequestRows, StagedRows, StepRows, decode_rows
from vllm_specextend.retrieval.target_tap import TargetAttentionTap

# decode_rows and the planner's data types are imported from here by callers and tests.
__all__ = [
    "DraftView",
    "PrivateLayouts",
    "RetrievalPlanner",
    "WorkingCacheRewrite",
    "decode_rows",
]


class RetrievalPlanner(RequestRows, ChunkScoring, CompactLayout):
    """Chooses, per request and step, the KV blocks the draft attends to."""

    def __init__(
        self,
        config: SpecExtendConfig,
        *,
        max_num_reqs: int,
        max_model_len: int,
        max_num_speculative_tokens: int,
        draft_window: int,
        compact_positions: bool,
        device: torch.device,
        steps_in_flight: int = 2,
        sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
        requests: RequestSlots | None = None,
    ) -> None:
        """
        Args:
            steps_in_flight: engine steps whose index copies may still be
                read (``VllmConfig.max_concurrent_batches``); sizes staging.
            sum_over_ranks: sums per-chunk scores over tensor-parallel ranks,
                each of which scores its own heads (None: one rank).
            requests: the drafter's request slots, shared with goodput
                control and updated by the drafter each step (None: its own,
                updated by :meth:`plan`).
        """
        self.config = config
        self.max_model_len = max_model_len
        self.max_num_speculative_tokens = max_num_speculative_tokens
        self.draft_window = draft_window
        self.compact_positions = compact_positions
        self.device = device
        self.stats = RetrievalStats(max_num_reqs=max_num_reqs, device=device)
        super().__init__(RequestSlots.shared_or_new(requests, max_num_reqs))
        self._owns_requests = requests is None
        self._max_num_reqs = max_num_reqs
        self._sum_over_ranks = sum_over_ranks
        self.tap: TargetAttentionTap | None = None
        self.block_size = -1
        self.chunk_size = -1
        self._selected_blocks: torch.Tensor | None = None
        self._score_sums: torch.Tensor | None = None
        self.scoring_workspace: ScoringWorkspace | None = None
        self._index_stager = IndexStager(max_num_reqs, device, depth=max(2, steps_in_flight))
        self._work_lists = WorkLists(max_num_reqs, device, depth=max(2, steps_in_flight))
        """The scoring kernels' work lists (``retrieval/kernels/scoring_work.py``)."""
        self.private_layouts: PrivateLayouts | None = None
        self._free_areas: list[int] = []
        self._private_blocks = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        """Per request slot: leading kept blocks held in its private area."""
        self.layouts_in_place = 0
        """Requests laid out in place for want of a free private area."""
        self._slot_of_row = np.full(max_num_reqs, -1, dtype=np.int64)
        self._due_of_row = np.zeros(max_num_reqs, dtype=np.int64)
        self.use_kernels = device.type == "cuda"
        """Plan on the Triton kernels (selection, rewrite, record:
        ``retrieval/kernels/selection_triton.py``), as on CUDA; scoring follows its
        workspace's ``use_kernel``."""

    def allocate_scoring_workspace(self, scoring_layer, dtype: torch.dtype) -> None:
        """Scoring's fixed workspace; call at model load, before vLLM
        measures free memory, so the KV cache is sized with it counted."""
        self.scoring_workspace = ScoringWorkspace.allocate(
            num_heads=scoring_layer.num_heads,
            num_kv_heads=scoring_layer.num_kv_heads,
            head_dim=scoring_layer.head_size,
            max_num_reqs=self._max_num_reqs,
            # accepted_tokens scores K + 1 rows per request (reconfigure may switch).
            max_query_rows=self.max_num_speculative_tokens + 1,
            dtype=dtype,
            device=self.device,
            max_context_len=self.max_model_len,
        )

    def bind_kv_cache(
        self,
        tap: TargetAttentionTap,
        block_size: int,
        private_layouts: PrivateLayouts | None = None,
    ) -> None:
        """Size the selection state once the KV cache layout is known."""
        self.tap = tap
        self.block_size = block_size
        if private_layouts is not None and not private_layouts.areas:
            private_layouts = None
        self.private_layouts = private_layouts
        self._free_areas = list(range(self.private_layouts.areas)) if self.private_layouts else []
        self.config.check_chunk_size(block_size)
        self.chunk_size = self.config.resolved_chunk_size(block_size)
        self._allocate_selection_state()
        self._warm_up_kernels()

    def _warm_up_kernels(self) -> None:
        """Compile the CUDA kernels now, not in the first serving step."""
        if self.scoring_workspace is not None:
            self.scoring_workspace.warm_up(self.block_size, self.chunk_size)
        if self.use_kernels:
            from vllm_specextend.retrieval.kernels.selection_triton import warm_up

            assert self._selected_blocks is not None and self._score_sums is not None
            warm_up(self._selected_blocks, self._score_sums, *self.stats.device_counters,
                    **self._selection_variant)

    def _allocate_selection_state(self) -> None:
        max_blocks = -(-self.max_model_len // self.block_size)
        self._selected_blocks = torch.ones(
            self._max_num_reqs, max_blocks, dtype=torch.bool, device=self.device
        )
        self._score_sums = torch.zeros(
            self._max_num_reqs,
            -(-self.max_model_len // self.chunk_size),
            dtype=torch.float32,
            device=self.device,
        )

    def reconfigure(self, config: SpecExtendConfig) -> None:
        """Swap retrieval options between requests (the benchmarks do, through
        ``benchmarks/worker_hooks.py``, to serve several configurations from one engine);
        mode ``off`` drafts as stock vLLM does.

        Every request's selection is dropped and recomputed at its next step.
        """
        if self.compact_positions and not config.retrieves:
            raise ValueError("compact draft positions need retrieval (cmr or streaming)")
        self.config = config
        config.check_chunk_size(self.block_size)
        self.chunk_size = config.resolved_chunk_size(self.block_size)
        self._forget_all(finished=False)
        self._allocate_selection_state()
        self._warm_up_kernels()

    # ---- planning ---------------------------------------------------------

    def plan(self, batch: PlanningBatch) -> DraftView | None:
        """The draft's view for this step, or None when every row sees all."""
        slots = self.requests.of_step(batch.req_ids, self._owns_requests)
        if not self.config.retrieves:
            self._forget_all()
            return None
        step = self._classify_rows(batch, slots)
        if step.empty:
            return None
        staged = self._stage(batch, step)
        if self.config.mode == "cmr":
            self._score(batch, step, staged)
        if self.use_kernels and not step.windowed_prefill_rows.size:
            return self._plan_decode_rows_on_kernels(batch, step, staged)
        num_reqs = batch.num_reqs
        query_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1])[:num_reqs]
        first_query_pos = batch.seq_lens[:num_reqs] - query_lens
        num_rows = batch.seq_lens.shape[0]
        keep = torch.ones(
            num_rows, batch.block_table.shape[1], dtype=torch.bool, device=self.device
        )
        rewrites: list[WorkingCacheRewrite] = []
        if step.due_rows.size:
            rewrites += self._retrieve(batch, step, staged, _draft_query_starts(batch))
        if step.retrieval_rows.size:
            assert self._selected_blocks is not None
            num_blocks = self._num_blocks(batch)
            keep[staged.rows, :num_blocks] = self._selected_blocks[staged.slots, :num_blocks]
        if step.windowed_prefill_rows.size:
            rewrites += self._lay_out_windowed_prefill(
                batch, step, keep, first_query_pos, query_lens
            )
        if self.use_kernels:
            compact, removed, kept_context_lens = rewrite_rows_and_record(
                batch.block_table[:num_rows], keep, staged.slot_of_row, batch.seq_lens,
                batch.query_start_loc, batch.last_token_indices, self.block_size,
                *self.stats.device_counters)
            self.stats.compacted_request_steps += int(step.retrieval_rows.size)
        else:
            compact, removed = rewrite_block_table(
                batch.block_table[:num_rows], keep, self.block_size, use_kernel=False)
            if step.retrieval_rows.size:
                self._record(batch, staged, removed)
            kept_context_lens = first_query_pos - removed[:num_reqs]
        kept_block_table = None
        if step.private_rows.size:
            kept_block_table = compact
            compact = self._swap_in_private_blocks(
                batch, step, compact, kept_context_lens)
        return DraftView(
            block_table=compact,
            removed_tokens=removed,
            kept_context_lens=kept_context_lens,
            rewrites=rewrites,
            kept_block_table=kept_block_table,
        )

    def _plan_decode_rows_on_kernels(
        self, batch: PlanningBatch, step: StepRows, staged: StagedRows
    ) -> DraftView:
        """:meth:`plan` after scoring for a step without windowed prompt
        chunks, on CUDA: the selections of the rows due, the rewrite of every
        row, the kept lengths and the record in one launch; the torch path
        (the rest of ``plan``) is the reference."""
        assert self._selected_blocks is not None and self._score_sums is not None
        rewrites = self._retrieved(staged) if step.due_rows.size else []
        compact, removed, kept_context_lens = select_and_rewrite_decode_rows(
            self._score_sums, self._selected_blocks, batch.block_table[: batch.seq_lens.shape[0]],
            staged.slot_of_row, staged.due_of_row, self._num_blocks(batch), batch.seq_lens,
            batch.query_start_loc, batch.last_token_indices, self.block_size,
            self.config.recent_tokens, *self._selection_options,
            *self.stats.device_counters, **self._selection_variant,
            window_query_start_loc=batch.draft_query_start_loc)
        self.stats.compacted_request_steps += int(step.retrieval_rows.size)
        kept_block_table = None
        if step.private_rows.size:
            kept_block_table = compact
            compact = self._swap_in_private_blocks(batch, step, compact, kept_context_lens)
        return DraftView(block_table=compact, removed_tokens=removed,
                         kept_context_lens=kept_context_lens, rewrites=rewrites,
                         kept_block_table=kept_block_table)

    def _stage(self, batch: PlanningBatch, step: StepRows) -> StagedRows:
        lists = [step.retrieval_rows, step.retrieval_slots, step.due_rows, step.due_slots]
        self._work_lists.next_step()
        if self.use_kernels:  # only the kernels read rows by slot
            slot_of_row = self._slot_of_row[: batch.num_reqs]
            slot_of_row.fill(-1)
            slot_of_row[step.retrieval_rows] = step.retrieval_slots
            due_of_row = self._due_of_row[: batch.num_reqs]
            due_of_row.fill(0)
            due_of_row[step.due_rows] = 1
            lists += [slot_of_row, due_of_row]
        staged = self._index_stager.next_step().stage(*lists)
        if not self.use_kernels:
            return StagedRows(*staged)
        return StagedRows(*staged[:4], slot_of_row=staged[4], due_of_row=staged[5])

    def _num_blocks(self, batch: PlanningBatch) -> int:
        assert self._selected_blocks is not None
        return min(batch.block_table.shape[1], self._selected_blocks.shape[1])

    @property
    def _selection_variant(self) -> dict[str, bool]:
        """The selection launch's compiled variant: streaming ranks chunks by
        position; accepted-token scores restart at each retrieval."""
        return {"by_position": self.config.mode != "cmr",
                "zero_scores": self.config.score_aggregation == "accepted_tokens"}

    @property
    def _selection_options(self) -> tuple[int, int, int]:
        """Top-k chunks, sink blocks, blocks per chunk."""
        return (self.config.resolved_top_k_chunks(self.chunk_size), self._sink_blocks,
                self.chunk_size // self.block_size)

    def _retrieve(
        self,
        batch: PlanningBatch,
        step: StepRows,
        staged: StagedRows,
        first_query_pos: torch.Tensor,
    ) -> list[WorkingCacheRewrite]:
        """New selections for the rows due: sink + top-k chunks + recent
        (``first_query_pos``: the rows' first-pass query starts, catch-up
        included)."""
        config = self.config
        assert self._selected_blocks is not None and self._score_sums is not None
        due, due_slots = staged.due, staged.due_slots
        num_blocks = self._num_blocks(batch)
        if config.mode == "cmr":
            scores = self._score_sums[due_slots]
        else:
            # Streaming: the most recent chunks win the top-k.
            num_chunks = self._score_sums.shape[1]
            scores = torch.arange(num_chunks, device=self.device, dtype=torch.float32)
            scores = scores.expand(len(step.due_rows), num_chunks)
        recent_start_block = (
            (first_query_pos[due] - config.recent_tokens).clamp(min=0) // self.block_size
        )
        top_k_chunks, sink_blocks, blocks_per_chunk = self._selection_options
        self._selected_blocks[due_slots, :num_blocks] = select_blocks(
            scores, recent_start_block, top_k_chunks=top_k_chunks, sink_blocks=sink_blocks,
            blocks_per_chunk=blocks_per_chunk, num_blocks=num_blocks,
            use_kernel=self.use_kernels)
        if config.score_aggregation == "accepted_tokens":
            # A fill through device indices (a Python scalar through an
            # index would be copied to the device, blocking).
            self._score_sums.index_fill_(0, due_slots, 0.0)
        return self._retrieved(staged)

    def _retrieved(self, staged: StagedRows) -> list[WorkingCacheRewrite]:
        """Compact positions: the rows due re-position their kept context,
        at most the working cache before the query."""
        if not self.compact_positions:
            return []
        working_cache = self.config.working_cache_tokens(
            self.block_size, self.max_num_speculative_tokens
        )
        return [WorkingCacheRewrite(staged.due, working_cache)]

    def _record(self, batch: PlanningBatch, staged: StagedRows, removed: torch.Tensor) -> None:
        self.stats.record_rows(
            staged.rows, staged.slots, batch.seq_lens, removed, batch.last_token_indices,
            batch.query_start_loc,
        )

    @property
    def _sink_blocks(self) -> int:
        return -(-self.config.sink_tokens // self.block_size)

    # ---- per-request state ------------------------------------------------

    def metrics_snapshot(self) -> dict[str, object]:
        """Aggregate and per-request retrieval figures (reads the device)."""
        return {
            **self.stats.as_dict(),
            "tracked_requests": int(self._rows.tracked.sum()),
            "private_layout_areas": self.private_layouts.areas if self.private_layouts else 0,
            "layouts_in_place": self.layouts_in_place,
            "request_kept_fraction": self.stats.request_kept_fraction.as_dict(),
            "request_acceptance_length": self.stats.request_acceptance_length.as_dict(),
            "requests": {
                req_id: {"retrievals": int(self._rows.refresh_counts[slot].sum()),
                         "refreshes": dict(zip(REFRESH_CAUSES,
                                               self._rows.refresh_counts[slot].tolist())),
                         **self.stats.request_figures(slot)}
                for req_id, slot in self.tracked_requests().items()
            },
        }


def _draft_query_starts(batch: PlanningBatch) -> torch.Tensor:
    """Each row's first position in the draft's first pass: its query's,
    or its catch-up's before it (the recent window is kept before it)."""
    starts = (batch.query_start_loc if batch.draft_query_start_loc is None
              else batch.draft_query_start_loc)
    num_reqs = batch.num_reqs
    return batch.seq_lens[:num_reqs] - (starts[1:] - starts[:-1])[:num_reqs]
