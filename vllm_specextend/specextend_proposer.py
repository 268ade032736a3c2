"""Draft-model proposer whose draft attends only to target-chosen context
(vLLM's V1 model runner).

The diff against vLLM's ``DraftModelProposer``:
- ``load_model`` finds the target's last attention layer;
- ``initialize_attn_backend`` taps it, sized to the KV cache;
- ``propose`` plans, per request, which KV blocks the draft keeps (the shared
  :class:`RetrievalPlanner`, fed from the V1 attention metadata);
- ``build_per_group_and_layer_attn_metadata`` hands the draft's attention a
  compacted block table and shortened ``seq_lens``;
- with compact draft positions, ``_get_positions`` runs each compacted row at
  its position in the working cache (original position - removed tokens), and
  ``propose`` first re-positions the kept keys of rows whose selection changed.
Slot mappings, KV writes and the target's verification are stock, so outputs
are exactly the target's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from typing_extensions import override

from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_specextend import plugin_logger
from vllm_specextend.config import SpecExtendConfig, spec_extend_options
from vllm_specextend.draft_kv_copy import DraftKVCopy, install_draft_kv_copy
from vllm_specextend.repositioning import (
    RotaryLayout,
    token_rows,
    working_cache_slots,
)
from vllm_specextend.retrieval_planner import (
    DraftView,
    PlanningBatch,
    RetrievalPlanner,
    log_scoring_layer,
)
from vllm_specextend.target_tap import (
    TargetAttentionTap,
    kv_cache_group_of,
    last_target_layer,
    tap_bytes_per_token,
    tap_target_layer,
)
from vllm_specextend.vllm_seam import draft_window, uses_compact_positions

logger = plugin_logger(__name__)


class SpecExtendProposer(DraftModelProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.spec_extend_config = SpecExtendConfig.from_dict(
            spec_extend_options(vllm_config.additional_config)
        )
        self.runner = runner
        self.tap: TargetAttentionTap | None = None
        self.target_layer_name: str | None = None
        self.draft_window = draft_window(vllm_config)
        self.compact_positions = uses_compact_positions(
            vllm_config, self.spec_extend_config
        )
        self.planner = RetrievalPlanner(
            self.spec_extend_config,
            max_num_reqs=self.max_batch_size,
            max_model_len=self.max_model_len,
            # num_speculative_tokens of this step may be smaller (dynamic K).
            max_num_speculative_tokens=vllm_config.speculative_config.num_speculative_tokens,
            draft_window=self.draft_window,
            compact_positions=self.compact_positions,
            device=device,
        )
        self._draft_view: DraftView | None = None
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
        attention_layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        self.target_layer_name, self._target_layer = last_target_layer(
            attention_layers, self._draft_attn_layer_names
        )
        self._draft_layers = {
            name: layer for name, layer in attention_layers.items()
            if name in self._draft_attn_layer_names
        }
        self.planner.allocate_scoring_workspace(self._target_layer, self.dtype)
        log_scoring_layer(self.target_layer_name, self.spec_extend_config,
                          self.compact_positions, self.draft_window)

    @override
    def initialize_attn_backend(
        self,
        kv_cache_config: KVCacheConfig,
        kernel_block_sizes: list[int] | None = None,
    ) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        gid = kv_cache_group_of(
            kv_cache_config, self.target_layer_name, set(self._draft_layers)
        )
        assert gid == self.kv_cache_gid
        num_slots = kv_cache_config.num_blocks * self.block_size
        self.tap = tap_target_layer(
            self._target_layer, num_slots, self.max_num_tokens, self.dtype, self.device
        )
        self.planner.bind_kv_cache(self.tap, self.block_size)
        if self.compact_positions:
            self._install_draft_kv_copy(num_slots)

    def bytes_per_kv_token_outside_cache(self) -> int:
        """Memory per KV slot besides vLLM's cache: the tap's key copy and,
        with compact positions, the plain draft KV copy. The worker counts it
        when it sizes the KV cache."""
        tap_bytes = tap_bytes_per_token(self._target_layer, self.dtype)
        if not self.compact_positions:
            return tap_bytes
        return tap_bytes + self._kv_copy_bytes_per_token()

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

    def reconfigure(self, config: SpecExtendConfig) -> None:
        """Swap retrieval options between requests (used by the tuning sweep)."""
        self.planner.reconfigure(config)
        self.spec_extend_config = config

    # ---- the seam into drafting ------------------------------------------

    @override
    def propose(self, num_speculative_tokens, **kwargs) -> torch.Tensor:
        self._draft_view = self._plan_draft_view(
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
        cad: CommonAttentionMetadata,
        token_indices_to_sample: torch.Tensor | None,
        target_positions: torch.Tensor,
    ) -> DraftView | None:
        num_reqs = cad.num_reqs
        num_rows = cad.seq_lens.shape[0]
        query_start_cpu = cad.query_start_loc_cpu[: num_reqs + 1].numpy()
        query_lens_cpu = query_start_cpu[1:] - query_start_cpu[:-1]
        input_batch = self.runner.input_batch
        if cad.seq_lens_cpu_upper_bound is not None:
            context_lens_cpu = cad.seq_lens_cpu_upper_bound[:num_reqs].numpy() - query_lens_cpu
        else:
            context_lens_cpu = input_batch.num_computed_tokens_cpu[:num_reqs]
        if token_indices_to_sample is None:
            token_indices_to_sample = cad.query_start_loc[1 : num_reqs + 1] - 1
        view = self.planner.plan(
            PlanningBatch(
                req_ids=input_batch.req_ids[:num_reqs],
                query_start_loc=cad.query_start_loc[: num_reqs + 1],
                seq_lens=cad.seq_lens,
                block_table=cad.block_table_tensor[:num_rows],
                last_token_indices=token_indices_to_sample[:num_reqs],
                positions=target_positions[0] if target_positions.dim() == 2 else target_positions,
                query_lens_cpu=query_lens_cpu,
                context_lens_cpu=context_lens_cpu,
                prompt_lens_cpu=input_batch.num_prompt_tokens[:num_reqs],
            )
        )
        if view is not None and self.kv_copy is not None:
            for rewrite in view.rewrites:
                self._reposition_working_caches(
                    rewrite.rows, view.block_table, view.kept_context_lens,
                    rewrite.max_context_len,
                )
        return view

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
