"""SpecExtend in vLLM's V1 model runner: the overrides every V1 drafter shares.

vLLM's V1 drafters derive from ``SpecDecodeBaseProposer``
(``v1/spec_decode/llm_base_proposer.py``); :class:`V1Overrides` is mixed in
before the stock class, holds a :class:`DraftRetrieval` and, under goodput
control, a :class:`SpeculationControl`, and changes only this:

- ``load_model`` attaches :class:`DraftRetrieval` to the target's last
  attention layer (and gives an EAGLE head's control its kept hidden states);
- ``initialize_attn_backend`` binds it to the KV cache (tap, plain draft KV
  copy), and tells control which decode steps replay FULL CUDA graphs (vLLM
  has settled its graph mode by then);
- ``propose`` updates the request slots both features share, asks control
  for each request's drafts (none: the draft's forward is skipped), puts
  the tokens a skipped forward left behind before each request's query
  (``v1_catch_up.py``), and plans, per request, which KV blocks the draft
  keeps, from the V1 attention metadata;
- ``build_per_group_and_layer_attn_metadata`` hands the draft's attention a
  compacted block table and shortened ``seq_lens``;
- with compact draft positions, ``_get_positions`` runs each compacted row at
  its position in the working cache (original position - removed tokens).

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

from vllm_specextend.common.engine_checks import check_paused_steps_have_graphs
from vllm_specextend.common.engine_setup import (
    SETUP_ATTRIBUTE,
    full_decode_graph_query_len,
)
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.control.speculation_control import SpeculationControl
from vllm_specextend.control.warm_up import warm_up_control
from vllm_specextend.drafters.features import DrafterFeatures
from vllm_specextend.drafters.v1_catch_up import with_catch_up
from vllm_specextend.retrieval.owner import DraftRetrieval
from vllm_specextend.retrieval.planner import DraftView
from vllm_specextend.retrieval.repositioning import token_rows


class V1Overrides(DrafterFeatures):
    """Mixin for a ``SpecDecodeBaseProposer`` subclass: put it first."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        # Handed over by the runner that builds this drafter (patches/model_runners.py).
        setup = getattr(runner, SETUP_ATTRIBUTE)
        self.runner = runner
        self.requests = RequestSlots(self.max_batch_size)
        self.retrieval: DraftRetrieval | None = None
        if setup.config.retrieves:
            self.retrieval = DraftRetrieval(
                setup,
                max_num_reqs=self.max_batch_size,
                max_model_len=self.max_model_len,
                max_num_tokens=self.max_num_tokens,
                dtype=self.dtype,
                device=device,
                requests=self.requests,
            )
        self.control: SpeculationControl | None = None
        if setup.config.controls_speculation:
            warm_up_control()  # compiled (or loaded) now, not at the first step
            self.control = SpeculationControl.for_drafter(
                method=setup.method,
                num_speculative_tokens=setup.num_speculative_tokens,
                # A head fed the target's hidden states (EAGLE's default pathway).
                keeps_hidden_states=not self.needs_extra_input_slots,
                compact_positions=setup.compact_positions,
                steps_in_flight=setup.steps_in_flight,
                max_num_reqs=self.max_batch_size,
                max_num_tokens=self.max_num_tokens,
                device=device,
                requests=self.requests,
                prices_warm_up=setup.config.goodput_warm_up == "priced",
            )
            control = self.control  # also while the benchmarks rest it (drafter.control None)
            self.requests.subscribe(arrived=lambda req_ids, slots: control.limit_outputs(
                slots, self._max_tokens(req_ids)))
        self._draft_view: DraftView | None = None
        # Per flat draft token: compact position = original - shift.
        self._position_shift = torch.zeros(
            self.max_num_tokens, dtype=torch.int64, device=device
        )

    # ---- set-up -----------------------------------------------------------

    @override
    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        if self.retrieval is not None:
            self.retrieval.attach(
                get_layers_from_vllm_config(self.vllm_config, Attention),
                self._draft_attn_layer_names,
            )
        if self.control is not None:
            self.control.weigh_draft(self.model, target_model)
            if self.control.hidden_capacity:
                self.control.allocate_paused_hidden_states(self._target_hidden_width(),
                                                           self.dtype)

    def _max_tokens(self, req_ids: list[str]) -> list[int | None]:
        """Arriving requests' ``max_tokens``, for goodput control (the runner
        holds each one's sampling parameters from the step it arrives in)."""
        states = self.runner.requests
        params = [getattr(states.get(req_id), "sampling_params", None) for req_id in req_ids]
        return [getattr(p, "max_tokens", None) for p in params]

    def _target_hidden_width(self) -> int:
        """Width of the target hidden states ``propose`` receives: EAGLE-3's
        concatenated auxiliary layers (its ``fc`` input) or the target's own."""
        head = getattr(self.model, "model", None)
        if getattr(head, "use_aux_hidden_state", False):
            return head.fc_input_size
        return self.vllm_config.model_config.get_hidden_size()

    @override
    def initialize_attn_backend(
        self,
        kv_cache_config: KVCacheConfig,
        kernel_block_sizes: list[int] | None = None,
    ) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        if self.retrieval is not None:
            self.retrieval.bind_kv_cache(kv_cache_config, self.block_size, self.model)
            assert self.retrieval.kv_cache_gid == self.kv_cache_gid
        if self.control is not None:
            # vLLM has just settled its graph mode for the attention backends
            # (GPUModelRunner.initialize_attn_backend, before this call): it
            # may differ from the engine config's when the drafter was built.
            check_paused_steps_have_graphs(self.vllm_config)
            self.control.set_full_graph_query_len(
                full_decode_graph_query_len(self.vllm_config))

    # ---- the seam into drafting ------------------------------------------

    @override
    def propose(self, num_speculative_tokens, **kwargs) -> torch.Tensor:
        batch = self.planning_batch(
            cad=kwargs["common_attn_metadata"],
            token_indices_to_sample=kwargs.get("token_indices_to_sample"),
            target_positions=kwargs["target_positions"],
        )
        # The request slots' one writer: both features look this step's up.
        self.requests.update(batch.req_ids)
        if self.control is not None:
            block_table = self.runner.input_batch.block_table[self.kv_cache_gid]
            draft_steps = self.control.plan(
                batch, block_table.get_numpy_array()[: len(batch.req_ids)], self.block_size,
                kwargs.get("target_hidden_states"))
            if draft_steps is None:
                # Nobody drafts: no forward, no retrieval (caught up later).
                return torch.empty(len(batch.req_ids), 0, dtype=torch.int64,
                                   device=self.device)
            num_speculative_tokens = min(num_speculative_tokens, draft_steps)
            # Before retrieval plans: the catch-up runs as part of its rows'
            # queries, which the recent window is kept before.
            catch_up = self.control.catch_up(batch, self.runner.input_batch.token_ids_cpu)
            if catch_up is not None:
                kwargs = with_catch_up(kwargs, catch_up, self.block_size)
                first_pass = kwargs["common_attn_metadata"]
                batch.draft_query_start_loc = first_pass.query_start_loc[: batch.num_reqs + 1]
        if self.retrieval is not None:
            self._draft_view = self.retrieval.plan(batch)
        try:
            return super().propose(num_speculative_tokens, **kwargs)
        finally:
            self._draft_view = None
            self._position_shift.zero_()

    def planning_batch(
        self,
        cad: CommonAttentionMetadata,
        token_indices_to_sample: torch.Tensor | None,
        target_positions: torch.Tensor,
    ) -> PlanningBatch:
        """This step as the planner sees it, from the V1 attention metadata."""
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
        return PlanningBatch(
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

    @override
    def _get_positions(self, num_tokens: int) -> torch.Tensor:
        positions = super()._get_positions(num_tokens)
        kv_copy = None if self.retrieval is None else self.retrieval.kv_copy
        if kv_copy is None:
            return positions
        # The positions the draft runs at, read by the KV copy's tap too.
        # Real tokens stay inside the window by construction; the clamp keeps
        # padding tokens inside the draft's rotary table.
        out = kv_copy.token_positions[:num_tokens]
        torch.sub(positions, self._position_shift[:num_tokens], out=out)
        return out.clamp_(0, self.retrieval.draft_window - 1)

    @override
    def build_per_group_and_layer_attn_metadata(
        self, common_attn_metadata: CommonAttentionMetadata, draft_index: int = 0
    ) -> tuple[list[object], dict[str, object]]:
        view = self._draft_view
        if view is not None:
            # A copy: later draft steps advance the caller's seq_lens in place,
            # and slot mappings keep using the original block table.
            if self.retrieval.kv_copy is not None:
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
