"""Retrieval in Model Runner V2 (vLLM's default GPU runner): the overrides a
speculator needs, over MRV2's shared buffers.

:class:`MRV2Retrieval` is mixed in before the stock speculator class and
changes only this:

- ``load_model`` attaches :class:`DraftRetrieval` to the target's last
  attention layer;
- ``set_attn`` binds it to the KV cache (tap);
- ``propose`` plans, per request, the KV blocks the draft keeps, from MRV2's
  ``InputBatch``;
- ``_build_attn_metadata`` hands the draft's attention builders the compacted
  block table and shortened ``seq_lens``, at step 0 and at every draft step,
  through a one-build overlay of ``input_buffers`` / ``block_tables``.

Slot mappings come from MRV2's per-request block tables, so KV writes, like
the target's verification, are stock: outputs are exactly the target's.
Compact draft positions run in the V1 runner only; engine construction
refuses them with Model Runner V2.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn
from typing_extensions import override

from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.kv_cache_interface import KVCacheConfig

from vllm_specextend.core.planner import DraftView, PlanningBatch
from vllm_specextend.retrieval.engine_options import RetrievalSetup, resolve_setup
from vllm_specextend.retrieval.owner import DraftRetrieval


class _Overlay:
    """``base`` with some attributes replaced, for one attention metadata build."""

    def __init__(self, base: Any, **replaced: Any) -> None:
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


class MRV2Retrieval:
    """Mixin for an MRV2 speculator subclass: put it first."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        setup: RetrievalSetup | None = None,
    ):
        super().__init__(vllm_config, device)
        self.retrieval = DraftRetrieval(
            setup or resolve_setup(vllm_config),
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_tokens=self.max_num_tokens,
            dtype=self.dtype,
            device=device,
        )
        self._draft_view: DraftView | None = None
        # What the draft's attention reads while a view is active.
        self._removed_tokens = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
        self._compact_seq_lens = torch.zeros(
            self.max_num_reqs, dtype=torch.int32, device=device
        )
        self._compact_block_table: torch.Tensor | None = None

    # ---- set-up -----------------------------------------------------------

    @override
    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        self.retrieval.attach(
            get_layers_from_vllm_config(self.vllm_config, Attention),
            set(self.draft_attn_layer_names),
        )

    def bytes_per_kv_token_outside_cache(self) -> int:
        return self.retrieval.bytes_per_kv_token_outside_cache()

    @override
    def set_attn(
        self,
        model_state,
        kv_cache_config: KVCacheConfig,
        block_tables,
        target_input_buffers,
        target_attn_groups,
    ) -> None:
        super().set_attn(
            model_state, kv_cache_config, block_tables, target_input_buffers,
            target_attn_groups,
        )
        gid = self.retrieval.kv_cache_group(kv_cache_config)
        self.retrieval.bind_kv_cache(kv_cache_config, block_tables.block_sizes[gid])
        self._compact_block_table = torch.zeros_like(block_tables.input_block_tables[gid])

    # ---- the seam into drafting ------------------------------------------

    @override
    def propose(
        self,
        input_batch,
        attn_metadata,
        slot_mappings,
        last_hidden_states,
        aux_hidden_states,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        *args,
        dummy_run: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        if not dummy_run:
            self._activate(self.retrieval.plan(self.planning_batch(input_batch, num_rejected)))
        try:
            return super().propose(
                input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, *args,
                dummy_run=dummy_run, **kwargs,
            )
        finally:
            self._draft_view = None

    def planning_batch(self, input_batch, num_rejected: torch.Tensor) -> PlanningBatch:
        """This step as the planner sees it, from MRV2's ``InputBatch``."""
        num_reqs = input_batch.num_reqs
        query_start_loc = input_batch.query_start_loc[: num_reqs + 1]
        gid = self.retrieval.kv_cache_gid
        return PlanningBatch(
            req_ids=list(input_batch.req_ids[:num_reqs]),
            query_start_loc=query_start_loc,
            seq_lens=input_batch.seq_lens[:num_reqs],
            block_table=self.block_tables.input_block_tables[gid][:num_reqs],
            # The last accepted token: the query's end minus the rejected drafts.
            last_token_indices=query_start_loc[1:] - num_rejected[:num_reqs] - 1,
            positions=input_batch.positions,
            query_lens_cpu=np.diff(input_batch.query_start_loc_np[: num_reqs + 1]),
            context_lens_cpu=input_batch.num_computed_tokens_np[:num_reqs],
            prompt_lens_cpu=input_batch.prefill_len_np[:num_reqs],
        )

    def _activate(self, view: DraftView | None) -> None:
        """Stage ``view`` in the buffers the metadata builds will read."""
        self._draft_view = view
        if view is None:
            return
        assert self._compact_block_table is not None
        num_rows = view.removed_tokens.shape[0]
        gid = self.retrieval.kv_cache_gid
        self._compact_block_table.copy_(self.block_tables.input_block_tables[gid])
        self._compact_block_table[:num_rows] = view.block_table
        self._removed_tokens.zero_()
        self._removed_tokens[:num_rows] = view.removed_tokens

    @override
    def _build_attn_metadata(self, *args, **kwargs) -> dict[str, Any] | None:
        if self._draft_view is None:
            return super()._build_attn_metadata(*args, **kwargs)
        # Draft steps advance input_buffers.seq_lens in place before each
        # build; the compacted lengths follow them.
        torch.sub(self.input_buffers.seq_lens, self._removed_tokens, out=self._compact_seq_lens)
        tables = list(self.block_tables.input_block_tables)
        tables[self.retrieval.kv_cache_gid] = self._compact_block_table
        stock_buffers, stock_tables = self.input_buffers, self.block_tables
        self.input_buffers = _Overlay(stock_buffers, seq_lens=self._compact_seq_lens)
        self.block_tables = _Overlay(stock_tables, input_block_tables=tables)
        try:
            return super()._build_attn_metadata(*args, **kwargs)
        finally:
            self.input_buffers, self.block_tables = stock_buffers, stock_tables
