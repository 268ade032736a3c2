"""Per-step retrieval planning, shared by every runner that hosts the draft.

A runner describes its verification step as a :class:`PlanningBatch`; the
planner answers with the draft's view of the KV cache (:class:`DraftView`):
a compacted block table and the tokens removed per row. It keeps the
per-request state (when each request last retrieved, its chunk scores and
selected blocks) and the retrieval figures. Scoring, selection and rewriting
are the pure functions of ``retrieval.py`` and ``repositioning.py``.

vLLM's V1 runner (``SpecExtendProposer``) and Model Runner V2
(``SpecExtendARSpeculator``) each build the batch from their own inputs and
hand the view to their draft's attention metadata; nothing else differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specextend import plugin_logger
from vllm_specextend.config import SpecExtendConfig
from vllm_specextend.repositioning import streaming_recent_start_block
from vllm_specextend.retrieval import rewrite_block_table, select_blocks
from vllm_specextend.scoring import (
    ScoringWorkspace,
    chunk_attention_sums,
    chunk_token_counts,
)
from vllm_specextend.stats import RetrievalStats
from vllm_specextend.target_tap import TargetAttentionTap

logger = plugin_logger(__name__)


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


def log_scoring_layer(
    layer_name: str, config: SpecExtendConfig, compact_positions: bool, draft_window: int
) -> None:
    logger.info(
        "SpecExtend: scoring with the target's last attention layer %s "
        "(mode=%s, draft positions %s, draft window %d)",
        layer_name, config.mode, "compact" if compact_positions else "original",
        draft_window,
    )


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


class IndexStager:
    """Host lists of batch rows or request slots as device index tensors,
    without a host sync: numpy writes into pinned staging rows, then
    ``non_blocking`` copies into device buffers. Two sets of rows alternate
    between steps, so a step never overwrites rows the previous step's
    copies may still read."""

    MAX_INDEX_LISTS_PER_STEP = 8

    def __init__(self, max_len: int, device: torch.device) -> None:
        shape = (2, self.MAX_INDEX_LISTS_PER_STEP, max_len)
        on_host = device.type == "cpu"
        self._host = torch.zeros(shape, dtype=torch.int64, pin_memory=not on_host
                                 and torch.cuda.is_available())
        self._host_np = self._host.numpy()
        self._device = self._host if on_host else torch.zeros(shape, dtype=torch.int64,
                                                              device=device)
        self._set = 0
        self._used = 0

    def next_step(self) -> IndexStager:
        self._set ^= 1
        self._used = 0
        return self

    def __call__(self, values: list[int]) -> torch.Tensor:
        index = self._used
        self._used += 1
        count = len(values)
        self._host_np[self._set, index, :count] = values
        staged = self._device[self._set, index, :count]
        if self._device is not self._host:
            staged.copy_(self._host[self._set, index, :count], non_blocking=True)
        return staged


def _sum_over_tensor_parallel_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Each rank scores its own heads: the sum makes every rank pick alike."""
    try:
        from vllm.distributed import (
            get_tensor_model_parallel_world_size,
            model_parallel_is_initialized,
            tensor_model_parallel_all_reduce,
        )
    except ImportError:  # the pure-torch layer alone, without vLLM
        return scores
    if not model_parallel_is_initialized() or get_tensor_model_parallel_world_size() == 1:
        return scores
    return tensor_model_parallel_all_reduce(scores)


@dataclass
class _RequestState:
    slot: int
    steps_since_retrieval: int = 0
    has_selection: bool = False
    retrievals: int = 0


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
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.max_num_speculative_tokens = max_num_speculative_tokens
        self.draft_window = draft_window
        self.compact_positions = compact_positions
        self.device = device
        self.stats = RetrievalStats(max_requests=max_num_reqs, device=device)
        self._requests: dict[str, _RequestState] = {}
        self._free_slots = list(range(max_num_reqs))
        self._max_num_reqs = max_num_reqs
        self.tap: TargetAttentionTap | None = None
        self.block_size = -1
        self.chunk_size = -1
        self._selected_blocks: torch.Tensor | None = None
        self._score_sums: torch.Tensor | None = None
        self.scoring_workspace: ScoringWorkspace | None = None
        self._index_stager = IndexStager(max_num_reqs, device)

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
        )

    def bind_kv_cache(self, tap: TargetAttentionTap, block_size: int) -> None:
        """Size the selection state once the KV cache layout is known."""
        self.tap = tap
        self.block_size = block_size
        self.chunk_size = self.config.resolved_chunk_size(block_size)
        self._allocate_selection_state()
        logger.info(
            "SpecExtend: %d-token chunks, top %d chunks + %d sink + %d recent tokens",
            self.chunk_size,
            self.config.resolved_top_k_chunks(self.chunk_size),
            self.config.sink_tokens,
            self.config.recent_tokens,
        )

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
        if self.compact_positions and not config.enabled:
            raise ValueError("compact draft positions need retrieval (cmr or streaming)")
        self.config = config
        self.chunk_size = config.resolved_chunk_size(self.block_size)
        for req_id in list(self._requests):
            self._forget(req_id, finished=False)
        self._allocate_selection_state()

    # ---- planning ---------------------------------------------------------

    def plan(self, batch: PlanningBatch) -> DraftView | None:
        """The draft's view for this step, or None when every row sees all."""
        config = self.config
        if not config.enabled:
            self._forget_requests_not_in([])
            return None
        k = self.max_num_speculative_tokens
        num_reqs = batch.num_reqs
        self._forget_requests_not_in(batch.req_ids)

        is_decode = decode_rows(
            batch.query_lens_cpu, batch.context_lens_cpu, batch.prompt_lens_cpu, k
        )
        seq_lens_cpu = np.asarray(batch.context_lens_cpu) + np.asarray(batch.query_lens_cpu)
        # Prefill rows get no retrieval: the draft writes their KV once, and
        # would keep KV computed from partial context for good.
        eligible = is_decode & (seq_lens_cpu >= max(config.min_context_tokens, 1))
        # Rows whose draft positions would leave the draft's window.
        beyond_window = seq_lens_cpu + k > self.draft_window
        if self.compact_positions:
            eligible |= is_decode & beyond_window

        rows: list[int] = []
        due_rows: list[int] = []
        # Long prompts, prefilled by the draft over sink + most recent blocks.
        windowed_prefill_rows: list[int] = []
        for row, req_id in enumerate(batch.req_ids):
            if not eligible[row]:
                if not is_decode[row]:
                    self._forget(req_id)
                    if self.compact_positions and beyond_window[row]:
                        windowed_prefill_rows.append(row)
                continue
            state = self._requests.get(req_id) or self._track(req_id)
            state.steps_since_retrieval += 1
            rows.append(row)
            if (
                not state.has_selection
                or state.steps_since_retrieval >= config.retrieval_interval
            ):
                due_rows.append(row)
        if not rows and not windowed_prefill_rows:
            return None

        device = self.device
        stage = self._index_stager.next_step()
        slot_of_row = {row: self._requests[batch.req_ids[row]].slot for row in rows}
        rows_t, row_slots = stage(rows), stage([slot_of_row[r] for r in rows])
        due, due_slots = stage(due_rows), stage([slot_of_row[r] for r in due_rows])
        block_table = batch.block_table
        query_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1])[:num_reqs]
        first_query_pos = batch.seq_lens[:num_reqs] - query_lens

        if config.mode == "cmr":
            accumulate = config.score_aggregation == "accepted_tokens"
            score_rows = rows if accumulate else due_rows
            if score_rows:
                self._accumulate_scores(
                    rows_t if accumulate else due,
                    row_slots if accumulate else due_slots,
                    batch,
                    int(seq_lens_cpu[score_rows].max()),
                    accumulate=accumulate,
                )

        assert self._selected_blocks is not None and self._score_sums is not None
        num_blocks = min(block_table.shape[1], self._selected_blocks.shape[1])
        sink_blocks = -(-config.sink_tokens // self.block_size)
        blocks_per_chunk = self.chunk_size // self.block_size
        rewrites: list[WorkingCacheRewrite] = []
        if due_rows:
            recent_start_block = (
                (first_query_pos[due] - config.recent_tokens).clamp(min=0)
                // self.block_size
            )
            if config.mode == "cmr":
                scores = self._score_sums[due_slots]
            else:
                # Streaming: the most recent chunks win the top-k.
                num_chunks = self._score_sums.shape[1]
                scores = torch.arange(num_chunks, device=device, dtype=torch.float32)
                scores = scores.expand(len(due_rows), num_chunks)
            keep = select_blocks(
                scores,
                recent_start_block,
                top_k_chunks=config.resolved_top_k_chunks(self.chunk_size),
                sink_blocks=sink_blocks,
                blocks_per_chunk=blocks_per_chunk,
                num_blocks=num_blocks,
            )
            self._selected_blocks[due_slots, :num_blocks] = keep
            if config.score_aggregation == "accepted_tokens":
                self._score_sums[due_slots] = 0.0
            for row in due_rows:
                state = self._requests[batch.req_ids[row]]
                state.has_selection = True
                state.steps_since_retrieval = 0
                state.retrievals += 1
            self.stats.retrievals += len(due_rows)
            if self.compact_positions:
                # Kept context before the query: at most the working cache.
                rewrites.append(
                    WorkingCacheRewrite(due, config.working_cache_tokens(self.block_size, k))
                )

        num_rows = batch.seq_lens.shape[0]
        keep_all = torch.ones(num_rows, block_table.shape[1], dtype=torch.bool, device=device)
        if rows:
            keep_all[rows_t, :num_blocks] = self._selected_blocks[row_slots, :num_blocks]
        if windowed_prefill_rows:
            prefill = stage(windowed_prefill_rows)
            recent_start_block = streaming_recent_start_block(
                first_query_pos[prefill], query_lens[prefill], k,
                sink_blocks, self.draft_window, self.block_size,
            )
            keep_all[prefill, :num_blocks] = select_blocks(
                self._score_sums.new_empty(len(windowed_prefill_rows), 0),
                recent_start_block,
                top_k_chunks=0,
                sink_blocks=sink_blocks,
                blocks_per_chunk=blocks_per_chunk,
                num_blocks=num_blocks,
            )
            rewrites.append(WorkingCacheRewrite(prefill, self.draft_window))
        compact, removed = rewrite_block_table(
            block_table[:num_rows], keep_all, self.block_size
        )
        if rows:
            # Tokens gained at the verification just done: accepted drafts + 1.
            accepted = (
                batch.last_token_indices[rows_t] - batch.query_start_loc[rows_t] + 1
            )
            self.stats.record_step(
                row_slots,
                context_tokens=batch.seq_lens[rows_t],
                removed_tokens=removed[rows_t],
                acceptance_lengths=torch.where(query_lens[rows_t] > 1, accepted, 0),
            )
        return DraftView(
            block_table=compact,
            removed_tokens=removed,
            kept_context_lens=first_query_pos - removed[:num_reqs],
            rewrites=rewrites,
        )

    def _accumulate_scores(
        self,
        rows_t: torch.Tensor,
        slots: torch.Tensor,
        batch: PlanningBatch,
        max_context_len: int,
        accumulate: bool,
    ) -> None:
        """Chunk scores from the target's last layer for the given batch rows."""
        tap = self.tap
        assert tap is not None and self._score_sums is not None
        num_query_rows = self.max_num_speculative_tokens + 1 if accumulate else 1
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
        sums = _sum_over_tensor_parallel_ranks(sums)
        counts = chunk_token_counts(batch.seq_lens[rows_t], sums.shape[1], self.chunk_size)
        scores = sums / counts.clamp(min=1)
        width = min(scores.shape[1], self._score_sums.shape[1])
        if accumulate:
            self._score_sums[slots, :width] += scores[:, :width]
        else:
            self._score_sums[slots] = 0.0
            self._score_sums[slots, :width] = scores[:, :width]

    # ---- per-request state ------------------------------------------------

    def metrics_snapshot(self) -> dict[str, object]:
        """Aggregate and per-request retrieval figures (reads the device)."""
        return {
            **self.stats.as_dict(),
            "tracked_requests": len(self._requests),
            "request_kept_fraction": self.stats.request_kept_fraction.as_dict(),
            "request_acceptance_length": self.stats.request_acceptance_length.as_dict(),
            "requests": {
                req_id: {"retrievals": state.retrievals,
                         **self.stats.request_figures(state.slot)}
                for req_id, state in self._requests.items()
            },
        }

    def _track(self, req_id: str) -> _RequestState:
        state = _RequestState(slot=self._free_slots.pop())
        self._requests[req_id] = state
        return state

    def _forget(self, req_id: str, finished: bool = True) -> None:
        state = self._requests.pop(req_id, None)
        if state is None:
            return
        if finished:
            self.stats.finish_request(state.slot)
        else:
            self.stats.clear_slot(state.slot)
        self._free_slots.append(state.slot)

    def _forget_requests_not_in(self, req_ids: list[str]) -> None:
        """Free the state of finished, aborted or preempted requests."""
        live = set(req_ids)
        for req_id in [r for r in self._requests if r not in live]:
            self._forget(req_id)
