"""Draft-model proposer whose draft attends only to target-chosen context.

The diff against vLLM's ``DraftModelProposer``:
- ``load_model`` taps the target's last attention layer (queries and keys);
- ``initialize_attn_backend`` sizes the tap's key buffer to the KV cache;
- ``propose`` plans, per request, which KV blocks the draft keeps;
- ``build_per_group_and_layer_attn_metadata`` hands the draft's attention a
  compacted block table and shortened ``seq_lens``;
- with compact draft positions, ``_get_positions`` runs each compacted row at
  its position in the working cache (original position - removed tokens), and
  ``propose`` first re-positions the kept keys of rows whose selection changed.
Slot mappings, KV writes and the target's verification are stock, so outputs
are exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from typing_extensions import override

from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed import (
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_specextend import plugin_logger
from vllm_specextend.config import SpecExtendConfig, spec_extend_options
from vllm_specextend.draft_kv_copy import DraftKVCopy, install_draft_kv_copy
from vllm_specextend.repositioning import (
    RotaryLayout,
    streaming_recent_start_block,
    token_rows,
    working_cache_slots,
)
from vllm_specextend.retrieval import (
    attention_scores,
    chunk_scores,
    context_keys,
    rewrite_block_table,
    select_blocks,
)
from vllm_specextend.stats import RetrievalStats
from vllm_specextend.target_tap import TargetAttentionTap, install_tap
from vllm_specextend.vllm_seam import draft_window, uses_compact_positions

logger = plugin_logger(__name__)


@dataclass
class _RequestState:
    slot: int
    steps_since_retrieval: int = 0
    has_selection: bool = False
    retrievals: int = 0


@dataclass
class _DraftView:
    """What the draft's attention sees during one ``propose`` call."""

    block_table: torch.Tensor
    removed_tokens: torch.Tensor


class SpecExtendProposer(DraftModelProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.spec_extend_config = SpecExtendConfig.from_dict(
            spec_extend_options(vllm_config.additional_config)
        )
        self.runner = runner
        self.tap: TargetAttentionTap | None = None
        self.target_layer_name: str | None = None
        self.stats = RetrievalStats(max_requests=self.max_batch_size, device=device)
        self._requests: dict[str, _RequestState] = {}
        self._free_slots = list(range(self.max_batch_size))
        self._draft_view: _DraftView | None = None
        # Sized once the KV cache (block size, block table width) is known.
        self._selected_blocks: torch.Tensor | None = None
        self._score_sums: torch.Tensor | None = None
        self.chunk_size = -1
        self.draft_window = draft_window(vllm_config)
        self.compact_positions = uses_compact_positions(
            vllm_config, self.spec_extend_config
        )
        self.kv_copy: DraftKVCopy | None = None
        self._draft_layers: dict[str, Attention] = {}
        # Per flat draft token: compact position = original - shift.
        self._position_shift = torch.zeros(
            self.max_num_tokens, dtype=torch.int64, device=device
        )

    # ---- set-up -----------------------------------------------------------

    @override
    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        target_layers = {
            name: layer
            for name, layer in get_layers_from_vllm_config(
                self.vllm_config, Attention
            ).items()
            if name not in self._draft_attn_layer_names
        }
        if not target_layers:
            raise ValueError("SpecExtend found no attention layer in the target model")
        self.target_layer_name = max(target_layers, key=extract_layer_index)
        self._target_layer = target_layers[self.target_layer_name]
        self._draft_layers = {
            name: layer
            for name, layer in get_layers_from_vllm_config(
                self.vllm_config, Attention
            ).items()
            if name in self._draft_attn_layer_names
        }
        logger.info(
            "SpecExtend: scoring with the target's last attention layer %s "
            "(mode=%s, draft positions %s, draft window %d)",
            self.target_layer_name,
            self.spec_extend_config.mode,
            "compact" if self.compact_positions else "original",
            self.draft_window,
        )

    @override
    def initialize_attn_backend(
        self,
        kv_cache_config: KVCacheConfig,
        kernel_block_sizes: list[int] | None = None,
    ) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        groups = [
            gid
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            if self.target_layer_name in group.layer_names
        ]
        if groups != [self.kv_cache_gid]:
            raise ValueError(
                "SpecExtend needs the target's last attention layer and the draft's "
                "layers in one KV cache group (one shared block table); this model "
                f"has {len(kv_cache_config.kv_cache_groups)} KV cache groups "
                "(hybrid or sliding-window attention). Use a full-attention target."
            )
        self.chunk_size = self.spec_extend_config.resolved_chunk_size(self.block_size)
        logger.info(
            "SpecExtend: %d-token chunks, top %d chunks + %d sink + %d recent tokens",
            self.chunk_size,
            self.spec_extend_config.resolved_top_k_chunks(self.chunk_size),
            self.spec_extend_config.sink_tokens,
            self.spec_extend_config.recent_tokens,
        )
        layer = self._target_layer
        self.tap = TargetAttentionTap(
            num_slots=kv_cache_config.num_blocks * self.block_size,
            max_num_tokens=self.max_num_tokens,
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_size,
            scale=layer.impl.scale,
            dtype=self.dtype,
            device=self.device,
        )
        install_tap(layer, self.tap)
        if self.compact_positions:
            self._install_draft_kv_copy(kv_cache_config.num_blocks * self.block_size)
        self._allocate_selection_state()

    def kv_copy_memory_share(self) -> float:
        """Share of the KV cache budget to leave to the plain draft KV copy
        (0 without compact positions); the worker takes it off the memory it
        reports for the KV cache, so the copy is counted like the cache."""
        if not self.compact_positions:
            return 0.0
        specs = self.runner.get_kv_cache_spec()
        cache_per_token = sum(spec.page_size_bytes / spec.block_size for spec in specs.values())
        copy_per_token = self._kv_copy_bytes_per_token()
        return copy_per_token / (cache_per_token + copy_per_token)

    def _kv_copy_bytes_per_token(self) -> int:
        layer = next(iter(self._draft_layers.values()))
        return DraftKVCopy.bytes_per_token(
            len(self._draft_layers), layer.num_kv_heads, layer.head_size, self.dtype
        )

    def _install_draft_kv_copy(self, num_slots: int) -> None:
        layer = next(iter(self._draft_layers.values()))
        self.kv_copy = DraftKVCopy(
            layer_names=sorted(self._draft_layers),
            num_slots=num_slots,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_size,
            rotary=self._draft_rotary_layout(),
            max_num_tokens=self.max_num_tokens,
            dtype=self.dtype,
            device=self.device,
        )
        install_draft_kv_copy(self._draft_layers, self.kv_copy)
        bytes_per_token = self._kv_copy_bytes_per_token()
        logger.info(
            "SpecExtend: compact draft positions (window %d); plain draft KV copy "
            "of %d bytes per token, %.2f GiB for %d KV slots",
            self.draft_window, bytes_per_token, bytes_per_token * num_slots / 2**30,
            num_slots,
        )

    def _draft_rotary_layout(self) -> RotaryLayout:
        """The draft's rotary embedding: one layout shared by all its layers."""
        from vllm.model_executor.layers.rotary_embedding.base import (
            RotaryEmbeddingBase,
        )

        layouts = [
            RotaryLayout.of_module(module)
            for module in self.model.modules()
            if isinstance(module, RotaryEmbeddingBase)
        ]
        first = layouts[0] if layouts else None
        if first is None or any(
            (layout.rotary_dim, layout.is_neox_style) != (first.rotary_dim, first.is_neox_style)
            or not torch.equal(layout.inv_freq, first.inv_freq)
            for layout in layouts
        ):
            raise ValueError(
                "SpecExtend's compact draft positions re-rotate the draft's keys and "
                "need one rotary embedding shared by all draft layers; this draft has "
                f"{len(layouts)} differing or none. Set draft_positions='original' "
                "with a draft window as long as the target's."
            )
        return first

    def _allocate_selection_state(self) -> None:
        max_blocks = -(-self.max_model_len // self.block_size)
        self._selected_blocks = torch.ones(
            self.max_batch_size, max_blocks, dtype=torch.bool, device=self.device
        )
        self._score_sums = torch.zeros(
            self.max_batch_size,
            -(-self.max_model_len // self.chunk_size),
            dtype=torch.float32,
            device=self.device,
        )

    def reconfigure(self, config: SpecExtendConfig) -> None:
        """Swap retrieval options between requests (used by the tuning sweep).

        Every request's selection is dropped and recomputed at its next step.
        """
        if not config.enabled:
            raise ValueError("reconfigure needs an enabled mode (cmr or streaming)")
        self.spec_extend_config = config
        self.chunk_size = config.resolved_chunk_size(self.block_size)
        for req_id in list(self._requests):
            self._forget(req_id, finished=False)
        self._allocate_selection_state()

    # ---- the seam into drafting ------------------------------------------

    @override
    def propose(self, num_speculative_tokens, **kwargs) -> torch.Tensor:
        self._draft_view = self._plan_draft_view(
            num_speculative_tokens,
            cad=kwargs["common_attn_metadata"],
            token_indices_to_sample=kwargs.get("token_indices_to_sample"),
            target_positions=kwargs["target_positions"],
        )
        try:
            return super().propose(num_speculative_tokens, **kwargs)
        finally:
            self._draft_view = None
            self._position_shift.zero_()

    @override
    def _get_positions(self, num_tokens: int) -> torch.Tensor:
        positions = super()._get_positions(num_tokens)
        if self.kv_copy is None:
            return positions
        # The positions the draft runs at, read by the KV copy's tap too.
        # Real tokens stay inside the window by construction; the clamp keeps
        # padding tokens inside the draft's rotary table.
        out = self.kv_copy.token_positions[:num_tokens]
        torch.sub(positions, self._position_shift[:num_tokens], out=out)
        return out.clamp_(0, self.draft_window - 1)

    @override
    def build_per_group_and_layer_attn_metadata(
        self, common_attn_metadata: CommonAttentionMetadata, draft_index: int = 0
    ) -> tuple[list[object], dict[str, object]]:
        view = self._draft_view
        if view is not None:
            # A copy: later draft steps advance the caller's seq_lens in place,
            # and slot mappings keep using the original block table.
            if self.kv_copy is not None:
                self._shift_positions(common_attn_metadata, view.removed_tokens, draft_index)
            common_attn_metadata = common_attn_metadata.replace(
                block_table_tensor=view.block_table,
                seq_lens=common_attn_metadata.seq_lens - view.removed_tokens,
                _num_computed_tokens_cache=None,
            )
        return super().build_per_group_and_layer_attn_metadata(
            common_attn_metadata, draft_index
        )

    def _shift_positions(
        self, cad: CommonAttentionMetadata, removed_tokens: torch.Tensor, draft_index: int
    ) -> None:
        """Each draft token runs at its original position minus its row's removed tokens."""
        shift = self._position_shift
        if draft_index == 0:
            num_tokens = cad.num_actual_tokens
            rows = token_rows(cad.query_start_loc, num_tokens)
            per_row = torch.cat((removed_tokens.long(), removed_tokens.new_zeros(1).long()))
            shift.zero_()
            shift[:num_tokens] = per_row[rows]
        else:
            shift[: removed_tokens.shape[0]] = removed_tokens

    # ---- retrieval --------------------------------------------------------

    def _plan_draft_view(
        self,
        num_speculative_tokens: int,
        cad: CommonAttentionMetadata,
        token_indices_to_sample: torch.Tensor | None,
        target_positions: torch.Tensor,
    ) -> _DraftView | None:
        config = self.spec_extend_config
        num_reqs = cad.num_reqs
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        self._forget_requests_not_in(req_ids)

        query_start_cpu = cad.query_start_loc_cpu[: num_reqs + 1]
        query_lens_cpu = query_start_cpu[1:] - query_start_cpu[:-1]
        seq_lens_cpu = (
            cad.seq_lens_cpu_upper_bound
            if cad.seq_lens_cpu_upper_bound is not None
            else cad.seq_lens.cpu()
        )[:num_reqs]
        # Prefill rows get no retrieval: the draft writes their KV once, and
        # would keep KV computed from partial context for good.
        is_decode = query_lens_cpu <= num_speculative_tokens + 1
        eligible = is_decode & (seq_lens_cpu >= max(config.min_context_tokens, 1))
        # Rows whose draft positions would leave the draft's window.
        beyond_window = seq_lens_cpu + num_speculative_tokens > self.draft_window
        if self.kv_copy is not None:
            eligible |= is_decode & beyond_window

        rows: list[int] = []
        due_rows: list[int] = []
        # Long prompts, prefilled by the draft over sink + most recent blocks.
        windowed_prefill_rows: list[int] = []
        for row, req_id in enumerate(req_ids):
            if not eligible[row]:
                if not is_decode[row]:
                    self._forget(req_id)
                    if self.kv_copy is not None and beyond_window[row]:
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
        slots_of = lambda rs: torch.tensor(  # noqa: E731
            [self._requests[req_ids[r]].slot for r in rs], device=device
        )
        block_table = cad.block_table_tensor
        query_lens = (cad.query_start_loc[1:] - cad.query_start_loc[:-1])[:num_reqs]
        first_query_pos = cad.seq_lens[:num_reqs] - query_lens
        if token_indices_to_sample is None:
            token_indices_to_sample = cad.query_start_loc[1 : num_reqs + 1] - 1

        if config.mode == "cmr":
            score_rows = rows if config.score_aggregation == "accepted_tokens" else due_rows
            if score_rows:
                self._accumulate_scores(
                    score_rows,
                    slots_of(score_rows),
                    cad,
                    token_indices_to_sample,
                    target_positions,
                    int(seq_lens_cpu[score_rows].max()),
                    accumulate=config.score_aggregation == "accepted_tokens",
                )

        assert self._selected_blocks is not None and self._score_sums is not None
        num_blocks = min(block_table.shape[1], self._selected_blocks.shape[1])
        sink_blocks = -(-config.sink_tokens // self.block_size)
        blocks_per_chunk = self.chunk_size // self.block_size
        if due_rows:
            due = torch.tensor(due_rows, device=device)
            due_slots = slots_of(due_rows)
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
                state = self._requests[req_ids[row]]
                state.has_selection = True
                state.steps_since_retrieval = 0
                state.retrievals += 1
            self.stats.retrievals += len(due_rows)

        batch = cad.seq_lens.shape[0]
        keep_all = torch.ones(batch, block_table.shape[1], dtype=torch.bool, device=device)
        if rows:
            rows_t = torch.tensor(rows, device=device)
            keep_all[rows_t, :num_blocks] = self._selected_blocks[slots_of(rows), :num_blocks]
        if windowed_prefill_rows:
            prefill = torch.tensor(windowed_prefill_rows, device=device)
            recent_start_block = streaming_recent_start_block(
                first_query_pos[prefill], query_lens[prefill], num_speculative_tokens,
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
        compact, removed = rewrite_block_table(
            block_table[:batch], keep_all, self.block_size
        )
        if self.kv_copy is not None:
            # Their kept context moved: lay it out at positions 0, 1, ...
            context_lens = first_query_pos - removed[:num_reqs]
            if due_rows:
                # Kept context before the query: at most the working cache.
                self._reposition_working_caches(
                    due, compact, context_lens,
                    config.working_cache_tokens(self.block_size, num_speculative_tokens),
                )
            if windowed_prefill_rows:
                self._reposition_working_caches(prefill, compact, context_lens, self.draft_window)
        if rows:
            # Tokens gained at the verification just done: accepted drafts + 1.
            accepted = token_indices_to_sample[rows_t] - cad.query_start_loc[rows_t] + 1
            self.stats.record_step(
                slots_of(rows),
                context_tokens=cad.seq_lens[rows_t],
                removed_tokens=removed[rows_t],
                acceptance_lengths=torch.where(query_lens[rows_t] > 1, accepted, 0),
            )
        return _DraftView(block_table=compact, removed_tokens=removed)

    def _reposition_working_caches(
        self,
        rows: torch.Tensor,
        compact_table: torch.Tensor,
        context_lens: torch.Tensor,
        max_context_len: int,
    ) -> None:
        """Rewrite the kept context keys of ``rows`` (at most ``max_context_len``
        each) at their compact positions."""
        assert self.kv_copy is not None
        length = min(max_context_len, self.draft_window)
        slots, valid = working_cache_slots(
            compact_table[rows], context_lens[rows], length, self.block_size
        )
        positions = torch.arange(length, device=self.device).repeat(rows.shape[0])
        self.kv_copy.write_working_cache(
            self._draft_layers, slots.flatten(), valid.flatten(), positions
        )

    def _accumulate_scores(
        self,
        rows: list[int],
        slots: torch.Tensor,
        cad: CommonAttentionMetadata,
        token_indices_to_sample: torch.Tensor,
        target_positions: torch.Tensor,
        max_context_len: int,
        accumulate: bool,
    ) -> None:
        """Chunk scores from the target's last layer for the given batch rows."""
        tap = self.tap
        assert tap is not None and self._score_sums is not None
        rows_t = torch.tensor(rows, device=self.device)
        num_query_rows = (
            self.num_speculative_tokens + 1 if accumulate else 1
        )
        last = token_indices_to_sample[rows_t].long()
        query_index = last.view(-1, 1) - torch.arange(
            num_query_rows, device=self.device
        ).view(1, -1)
        valid = query_index >= cad.query_start_loc[rows_t].view(-1, 1)
        query_index = query_index.clamp(min=0)
        positions = target_positions[0] if target_positions.dim() == 2 else target_positions
        query_positions = torch.where(valid, positions[query_index], -1)
        keys = context_keys(
            tap.keys, cad.block_table_tensor[rows_t], max_context_len, self.block_size
        )
        token_scores = attention_scores(
            tap.queries[query_index], keys, query_positions, tap.scale
        ).sum(dim=1)
        if get_tensor_model_parallel_world_size() > 1:
            # Each rank holds some heads: sum them so all ranks pick alike.
            token_scores = tensor_model_parallel_all_reduce(token_scores)
        scores = chunk_scores(token_scores, cad.seq_lens[rows_t], self.chunk_size)
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

    @property
    def num_tracked_requests(self) -> int:
        return len(self._requests)

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
