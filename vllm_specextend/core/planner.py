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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specextend.core.counters import RetrievalStats
from vllm_specextend.core.options import SpecExtendConfig
from vllm_specextend.core.refresh import REFRESH_CAUSES, AcceptanceTrend
from vllm_specextend.core.repositioning import streaming_recent_start_block
from vllm_specextend.core.scoring import (
    ScoringWorkspace,
    chunk_attention_sums,
    chunk_token_counts,
)
from vllm_specextend.core.selection import rewrite_block_table, select_blocks
from vllm_specextend.core.staging import IndexStager
from vllm_specextend.core.target_tap import TargetAttentionTap


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


def decode_rows(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    prompt_lens: np.ndarray,
    max_num_speculative_tokens: int,
) -> np.ndarray:
    """Rows that verify drafts (or decode) rather than prefill.

    A row decodes when its prompt is already in the KV cache and its query
    holds at most one token plus ``max_num_speculative_tokens`` drafts. The
    prompt test keeps a last prefill chunk of K + 1 tokens or fewer a prefill;
    the bound on the configured K keeps steps with a reduced or dynamic K
    decodes; longer queries after the prompt (a preempted request recomputing
    its output) stay prefills.
    """
    return (np.asarray(context_lens) >= np.asarray(prompt_lens)) & (
        np.asarray(query_lens) <= max_num_speculative_tokens + 1
    )


@dataclass(frozen=True)
class PrivateLayouts:
    """Blocks kept out of the scheduler's pool: ``areas`` areas of
    ``blocks_per_area`` blocks from ``first_block`` on, one per request that
    has one, holding its re-positioned working cache."""

    first_block: int
    areas: int
    blocks_per_area: int


_NO_REFRESH = -1
_FIRST, _INTERVAL, _ACCEPTANCE = (REFRESH_CAUSES.index(c)
                                  for c in ("first", "interval", "acceptance"))


@dataclass
class _RequestState:
    slot: int
    refresh_counts: np.ndarray
    """``[len(REFRESH_CAUSES)]``: its row of the planner's per-slot counts."""
    area: int = -1
    """Its private layout area (-1: laid out in place)."""
    acceptance: AcceptanceTrend = field(default_factory=AcceptanceTrend)
    """Observed only with ``retrieval_refresh: acceptance``."""

    @property
    def refreshes(self) -> dict[str, int]:
        """Retrievals by cause."""
        return dict(zip(REFRESH_CAUSES, self.refresh_counts.tolist()))


def _rows() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class _StepRows:
    """This step's rows (numpy arrays of batch rows), classified on the host
    (no device reads)."""

    retrieval_rows: np.ndarray = field(default_factory=_rows)
    """Decode rows drafted through a selection."""
    retrieval_slots: np.ndarray = field(default_factory=_rows)
    """Their request slots."""
    due_rows: np.ndarray = field(default_factory=_rows)
    """Retrieval rows whose selection is recomputed this step."""
    due_slots: np.ndarray = field(default_factory=_rows)
    due_causes: np.ndarray = field(default_factory=_rows)
    """Why each due row retrieves (an index into ``REFRESH_CAUSES``)."""
    windowed_prefill_rows: np.ndarray = field(default_factory=_rows)
    """Compact positions: prompt chunks beyond the draft's window, prefilled
    over the sink and the most recent blocks."""
    last_prompt_chunk_rows: np.ndarray = field(default_factory=_rows)
    """cmr with compact positions: the windowed prompt chunks that end the
    prompt; they also attend to the chunks the target's attention picks, so
    the first drafts after the prompt already see them."""
    seq_lens: np.ndarray | None = None
    """``[num_reqs]``: context length including this step's query."""
    private_rows: np.ndarray = field(default_factory=_rows)
    """Rows with a private layout area (retrieval and windowed prefill)."""

    @property
    def empty(self) -> bool:
        return not self.retrieval_rows.size and not self.windowed_prefill_rows.size


@dataclass
class _StagedRows:
    """Device index tensors of the classified rows and their request slots."""

    rows: torch.Tensor
    slots: torch.Tensor
    due: torch.Tensor
    due_slots: torch.Tensor


class RetrievalPlanner:
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
    ) -> None:
        """
        Args:
            steps_in_flight: engine steps whose index copies may still be
                read (``VllmConfig.max_concurrent_batches``); sizes staging.
            sum_over_ranks: sums per-chunk scores over tensor-parallel ranks,
                each of which scores its own heads (None: one rank).
        """
        self.config = config
        self.max_model_len = max_model_len
        self.max_num_speculative_tokens = max_num_speculative_tokens
        self.draft_window = draft_window
        self.compact_positions = compact_positions
        self.device = device
        self.stats = RetrievalStats(max_num_reqs=max_num_reqs, device=device)
        self._requests: dict[str, _RequestState] = {}
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(max_num_reqs))
        # Per request slot, on the host: classification is numpy over these.
        self._decoded = np.zeros(max_num_reqs, dtype=bool)
        """Tracked since a decode step (else only through windowed prefill)."""
        self._steps_since_retrieval = np.zeros(max_num_reqs, dtype=np.int64)
        self._has_selection = np.zeros(max_num_reqs, dtype=bool)
        self._area_of_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        self._refresh_counts = np.zeros((max_num_reqs, len(REFRESH_CAUSES)), dtype=np.int64)
        self._max_num_reqs = max_num_reqs
        self._sum_over_ranks = sum_over_ranks
        self.tap: TargetAttentionTap | None = None
        self.block_size = -1
        self.chunk_size = -1
        self._selected_blocks: torch.Tensor | None = None
        self._score_sums: torch.Tensor | None = None
        self.scoring_workspace: ScoringWorkspace | None = None
        self._index_stager = IndexStager(max_num_reqs, device, depth=max(2, steps_in_flight))
        self.private_layouts: PrivateLayouts | None = None
        self._free_areas: list[int] = []
        self._private_blocks = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        """Per request slot: leading kept blocks held in its private area."""
        self.layouts_in_place = 0
        """Requests laid out in place for want of a free private area."""

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
        if self.scoring_workspace is not None:
            # Compiles the CUDA kernel now, not in the first serving step.
            self.scoring_workspace.warm_up(block_size, self.chunk_size)

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
        """Swap retrieval options between requests (used by the benchmarks);
        mode ``off`` drafts as stock vLLM does.

        Every request's selection is dropped and recomputed at its next step.
        """
        if self.compact_positions and not config.retrieves:
            raise ValueError("compact draft positions need retrieval (cmr or streaming)")
        self.config = config
        config.check_chunk_size(self.block_size)
        self.chunk_size = config.resolved_chunk_size(self.block_size)
        for req_id in list(self._requests):
            self._forget(req_id, finished=False)
        self._allocate_selection_state()
        if self.scoring_workspace is not None:
            self.scoring_workspace.warm_up(self.block_size, self.chunk_size)

    # ---- planning ---------------------------------------------------------

    def plan(self, batch: PlanningBatch) -> DraftView | None:
        """The draft's view for this step, or None when every row sees all."""
        if not self.config.retrieves:
            self._forget_requests_not_in([])
            return None
        self._forget_requests_not_in(batch.req_ids)
        step = self._classify_rows(batch)
        if step.empty:
            return None
        staged = self._stage(batch, step)
        num_reqs = batch.num_reqs
        query_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1])[:num_reqs]
        first_query_pos = batch.seq_lens[:num_reqs] - query_lens
        if self.config.mode == "cmr":
            self._score(batch, step, staged)

        num_rows = batch.seq_lens.shape[0]
        keep = torch.ones(
            num_rows, batch.block_table.shape[1], dtype=torch.bool, device=self.device
        )
        rewrites: list[WorkingCacheRewrite] = []
        if step.due_rows.size:
            rewrites += self._retrieve(batch, step, staged, first_query_pos)
        if step.retrieval_rows.size:
            assert self._selected_blocks is not None
            num_blocks = self._num_blocks(batch)
            keep[staged.rows, :num_blocks] = self._selected_blocks[staged.slots, :num_blocks]
        if step.windowed_prefill_rows.size:
            rewrites += self._lay_out_windowed_prefill(
                batch, step, keep, first_query_pos, query_lens
            )
        compact, removed = rewrite_block_table(
            batch.block_table[:num_rows], keep, self.block_size
        )
        if step.retrieval_rows.size:
            self._record(batch, staged, query_lens, removed)
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

    def _swap_in_private_blocks(
        self,
        batch: PlanningBatch,
        step: _StepRows,
        compact: torch.Tensor,
        kept_context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Private layouts: the whole context blocks of each re-positioned
        working cache are read from the request's own area (the rewrite
        writes them there); the block holding the query start and later
        ones, which only this request writes, stay in place."""
        layouts = self.private_layouts
        assert layouts is not None
        private_slots = self._slots_of_rows(batch.req_ids, step.private_rows)
        rows = self._index_stager(step.private_rows)
        slots = self._index_stager(private_slots)
        first_blocks = self._index_stager(
            layouts.first_block + self._area_of_slot[private_slots] * layouts.blocks_per_area)
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

    def _classify_rows(self, batch: PlanningBatch) -> _StepRows:
        """Host-side, numpy over per-slot state: which rows retrieve, which
        are due, which prefill windowed; tracks new requests and drops
        prefilling ones."""
        config = self.config
        k = self.max_num_speculative_tokens
        query_lens = np.asarray(batch.query_lens_cpu)
        context_lens = np.asarray(batch.context_lens_cpu)
        prompt_lens = np.asarray(batch.prompt_lens_cpu)
        is_decode = decode_rows(query_lens, context_lens, prompt_lens, k)
        seq_lens = context_lens + query_lens
        # Prefill rows get no retrieval: the draft writes their KV once, and
        # would keep KV computed from partial context for good.
        eligible = is_decode & (seq_lens >= max(config.min_context_tokens, 1))
        # Rows whose draft positions would leave the draft's window.
        beyond_window = seq_lens + k > self.draft_window
        if self.compact_positions:
            eligible |= is_decode & beyond_window
        step = _StepRows(seq_lens=seq_lens)
        if not is_decode.all():
            self._classify_prompt_chunks(batch, step, is_decode, beyond_window,
                                         seq_lens >= prompt_lens)

        rows = np.flatnonzero(eligible)
        slots = self._slots_of_rows(batch.req_ids, rows, track=True)
        self._decoded[slots] = True
        self._steps_since_retrieval[slots] += 1
        steps = self._steps_since_retrieval[slots]
        # As core.refresh.refresh_cause: first, then interval, then acceptance.
        causes = np.where(~self._has_selection[slots], _FIRST, np.where(
            steps >= config.retrieval_interval, _INTERVAL, _NO_REFRESH))
        if config.retrieval_refresh == "acceptance":
            self._acceptance_refreshes(batch, rows, steps, causes)
        due = causes != _NO_REFRESH
        step.retrieval_rows, step.retrieval_slots = rows, slots
        step.due_rows, step.due_slots, step.due_causes = rows[due], slots[due], causes[due]
        private = rows[self._area_of_slot[slots] >= 0]
        if step.private_rows.size:
            private = np.sort(np.concatenate((private, step.private_rows)))
        step.private_rows = private
        return step

    def _classify_prompt_chunks(self, batch: PlanningBatch, step: _StepRows,
                                is_decode: np.ndarray, beyond_window: np.ndarray,
                                ends_prompt: np.ndarray) -> None:
        """Prompt chunks (few rows a step): a request starts over, or, with
        compact positions beyond the window, prefills windowed."""
        windowed_rows, last_chunk_rows, private_rows = [], [], []
        for row in np.flatnonzero(~is_decode).tolist():
            req_id = batch.req_ids[row]
            windowed = self.compact_positions and bool(beyond_window[row])
            self._forget_unless_prefilling(req_id, windowed)
            if windowed:
                windowed_rows.append(row)
                if self.config.mode == "cmr" and ends_prompt[row]:
                    last_chunk_rows.append(row)
                if self._has_private_area(req_id):
                    private_rows.append(row)
        step.windowed_prefill_rows = np.array(windowed_rows, dtype=np.int64)
        step.last_prompt_chunk_rows = np.array(last_chunk_rows, dtype=np.int64)
        step.private_rows = np.array(private_rows, dtype=np.int64)

    def _slots_of_rows(self, req_ids: list[str], rows: np.ndarray,
                       track: bool = False) -> np.ndarray:
        """The request slots of ``rows`` (``track``: new requests get one)."""
        slots = np.fromiter(map(self._slot_of.get, req_ids, itertools.repeat(-1)),
                            dtype=np.int64, count=len(req_ids))[rows]
        if track:
            for index in np.flatnonzero(slots < 0).tolist():
                slots[index] = self._track(req_ids[rows[index]]).slot
        return slots

    def _acceptance_refreshes(self, batch: PlanningBatch, rows: np.ndarray, steps: np.ndarray,
                              causes: np.ndarray) -> None:
        """``retrieval_refresh: acceptance``: observe each row's acceptance
        and mark the rows whose acceptance dropped (a loop over the rows:
        this option only)."""
        drop = self.config.acceptance_drop
        for index, row in enumerate(rows.tolist()):
            trend = self._requests[batch.req_ids[row]].acceptance
            trend.observe(int(batch.context_lens_cpu[row]), int(batch.query_lens_cpu[row]),
                          int(steps[index]))
            if causes[index] == _NO_REFRESH and trend.dropped(drop):
                causes[index] = _ACCEPTANCE

    def _stage(self, batch: PlanningBatch, step: _StepRows) -> _StagedRows:
        return _StagedRows(*self._index_stager.next_step().stage(
            step.retrieval_rows, step.retrieval_slots, step.due_rows, step.due_slots))

    def _num_blocks(self, batch: PlanningBatch) -> int:
        assert self._selected_blocks is not None
        return min(batch.block_table.shape[1], self._selected_blocks.shape[1])

    def _score(self, batch: PlanningBatch, step: _StepRows, staged: _StagedRows) -> None:
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

    def _retrieve(
        self,
        batch: PlanningBatch,
        step: _StepRows,
        staged: _StagedRows,
        first_query_pos: torch.Tensor,
    ) -> list[WorkingCacheRewrite]:
        """New selections for the rows due: sink + top-k chunks + recent."""
        config = self.config
        assert self._selected_blocks is not None and self._score_sums is not None
        due, due_slots = staged.due, staged.due_slots
        recent_start_block = (
            (first_query_pos[due] - config.recent_tokens).clamp(min=0) // self.block_size
        )
        if config.mode == "cmr":
            scores = self._score_sums[due_slots]
        else:
            # Streaming: the most recent chunks win the top-k.
            num_chunks = self._score_sums.shape[1]
            scores = torch.arange(num_chunks, device=self.device, dtype=torch.float32)
            scores = scores.expand(len(step.due_rows), num_chunks)
        num_blocks = self._num_blocks(batch)
        keep = select_blocks(
            scores,
            recent_start_block,
            top_k_chunks=config.resolved_top_k_chunks(self.chunk_size),
            sink_blocks=self._sink_blocks,
            blocks_per_chunk=self.chunk_size // self.block_size,
            num_blocks=num_blocks,
        )
        self._selected_blocks[due_slots, :num_blocks] = keep
        if config.score_aggregation == "accepted_tokens":
            # A fill through device indices (a Python scalar through an
            # index would be copied to the device, blocking).
            self._score_sums.index_fill_(0, due_slots, 0.0)
        self._note_retrievals(batch, step)
        if not self.compact_positions:
            return []
        # Kept context before the query: at most the working cache.
        working_cache = config.working_cache_tokens(
            self.block_size, self.max_num_speculative_tokens
        )
        return [WorkingCacheRewrite(due, working_cache)]

    def _note_retrievals(self, batch: PlanningBatch, step: _StepRows) -> None:
        """Host bookkeeping of the rows that retrieved: new selections, by cause."""
        self._has_selection[step.due_slots] = True
        self._steps_since_retrieval[step.due_slots] = 0
        np.add.at(self._refresh_counts, (step.due_slots, step.due_causes), 1)
        for cause, count in zip(REFRESH_CAUSES, np.bincount(
                step.due_causes, minlength=len(REFRESH_CAUSES)).tolist()):
            self.stats.refreshes[cause] += count
        if self.config.retrieval_refresh == "acceptance":
            for row, cause in zip(step.due_rows.tolist(), step.due_causes.tolist()):
                self._requests[batch.req_ids[row]].acceptance.new_selection(
                    REFRESH_CAUSES[cause])

    def _lay_out_windowed_prefill(
        self,
        batch: PlanningBatch,
        step: _StepRows,
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
            scores = self._chunk_scores(rows_t, batch, int(seq_lens[rows].max()),
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
        )

    def _record(
        self,
        batch: PlanningBatch,
        staged: _StagedRows,
        query_lens: torch.Tensor,
        removed: torch.Tensor,
    ) -> None:
        rows = staged.rows
        # Tokens gained at the verification just done: accepted drafts + 1.
        accepted = batch.last_token_indices[rows] - batch.query_start_loc[rows] + 1
        self.stats.record_step(
            staged.slots,
            context_tokens=batch.seq_lens[rows],
            removed_tokens=removed[rows],
            acceptance_lengths=torch.where(query_lens[rows] > 1, accepted, 0),
        )

    @property
    def _sink_blocks(self) -> int:
        return -(-self.config.sink_tokens // self.block_size)

    def _accumulate_scores(
        self,
        rows_t: torch.Tensor,
        slots: torch.Tensor,
        batch: PlanningBatch,
        max_context_len: int,
        accumulate: bool,
    ) -> None:
        """Chunk scores from the target's last layer for the given batch rows,
        kept per request slot."""
        assert self._score_sums is not None
        num_query_rows = self.max_num_speculative_tokens + 1 if accumulate else 1
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
        tap = self.tap
        assert tap is not None
        last = batch.last_token_indices[rows_t].long()
        query_index = last.view(-1, 1) - torch.arange(
            num_query_rows, device=self.device
        ).view(1, -1)
        valid = query_index >= batch.query_start_loc[rows_t].view(-1, 1)
        query_index = query_index.clamp(min=0)
        query_positions = torch.where(valid, batch.positions[query_index], -1)
        assert self.scoring_workspace is not None
        sums = chunk_attention_sums(
            tap.queries[query_index], query_positions, tap.keys,
            batch.block_table[rows_t], max_context_len, tap.scale, self.block_size,
            self.chunk_size, self.scoring_workspace,
        )
        if self._sum_over_ranks is not None:
            sums = self._sum_over_ranks(sums)
        counts = chunk_token_counts(batch.seq_lens[rows_t], sums.shape[1], self.chunk_size)
        return sums / counts.clamp(min=1)

    # ---- per-request state ------------------------------------------------

    def metrics_snapshot(self) -> dict[str, object]:
        """Aggregate and per-request retrieval figures (reads the device)."""
        return {
            **self.stats.as_dict(),
            "tracked_requests": len(self._requests),
            "private_layout_areas": self.private_layouts.areas if self.private_layouts else 0,
            "layouts_in_place": self.layouts_in_place,
            "request_kept_fraction": self.stats.request_kept_fraction.as_dict(),
            "request_acceptance_length": self.stats.request_acceptance_length.as_dict(),
            "requests": {
                req_id: {"retrievals": int(state.refresh_counts.sum()),
                         "refreshes": state.refreshes,
                         **self.stats.request_figures(state.slot)}
                for req_id, state in self._requests.items()
            },
        }

    def _track(self, req_id: str) -> _RequestState:
        slot = self._free_slots.pop()
        state = _RequestState(slot=slot, refresh_counts=self._refresh_counts[slot])
        if self.private_layouts is not None:
            if self._free_areas:
                state.area = self._free_areas.pop()
            else:
                self.layouts_in_place += 1
        self._decoded[slot] = False
        self._steps_since_retrieval[slot] = 0
        self._has_selection[slot] = False
        self._area_of_slot[slot] = state.area
        state.refresh_counts[:] = 0
        self._requests[req_id] = state
        self._slot_of[req_id] = slot
        return state

    def _forget(self, req_id: str, finished: bool = True) -> None:
        state = self._requests.pop(req_id, None)
        if state is None:
            return
        del self._slot_of[req_id]
        if finished and self._decoded[state.slot]:
            self.stats.finish_request(state.slot)
        else:
            self.stats.clear_slot(state.slot)
        self._free_slots.append(state.slot)
        if state.area >= 0:
            self._free_areas.append(state.area)

    def _forget_unless_prefilling(self, req_id: str, windowed: bool) -> None:
        """A prompt chunk: the request starts over (a preempted request
        recomputes), except that with private layouts a windowed prefill
        keeps the state (and area) its earlier chunks made."""
        state = self._requests.get(req_id)
        if (state is None or not windowed or self.private_layouts is None
                or self._decoded[state.slot]):
            self._forget(req_id)

    def _has_private_area(self, req_id: str) -> bool:
        """With private layouts, a windowed prefill is tracked for its area."""
        if self.private_layouts is None:
            return False
        state = self._requests.get(req_id) or self._track(req_id)
        return state.area >= 0

    def _forget_requests_not_in(self, req_ids: list[str]) -> None:
        """Free the state of finished, aborted or preempted requests."""
        gone = self._requests.keys() - set(req_ids)
        # In tracking order: slots are freed (and reused) deterministically.
        for req_id in [r for r in self._requests if r in gone] if gone else ():
            self._forget(req_id)
