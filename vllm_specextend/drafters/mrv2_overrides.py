"""Retrieval in Model Runner V2 (vLLM's default GPU runner): the overrides every
MRV2 speculator shares, over MRV2's shared buffers.

:class:`MRV2Overrides` is mixed in before the stock speculator class and
changes only this:

- ``load_model`` attaches :class:`DraftRetrieval` to the target's last
  attention layer;
- ``set_attn`` binds it to the KV cache (tap) and allocates the compacted
  block table, once;
- ``propose`` plans, per request, the KV blocks the draft keeps, from MRV2's
  ``InputBatch``, and stages them in persistent buffers (the compacted block
  table, the tokens each row drops);
- every draft attention metadata build (``_build_attn_metadata``) reads the
  compacted block table and ``seq_lens`` minus the dropped tokens, through a
  one-build overlay of ``input_buffers`` / ``block_tables``;
- the fused decode path's in-place update (``_update_draft_decode_metadata``)
  recomputes the compacted lengths from the lengths it advanced, so they never
  go stale, inside captured CUDA graphs too.

- with compact draft positions, each adapter's ``_run_model`` runs the draft
  at ``_draft_positions`` (original minus the row's removed tokens).

The buffers are staged on every step (a plain copy of the block table when
nothing is compacted), so a graph captured over them replays the right view.
Slot mappings come from MRV2's per-request block tables and its own position
buffers, so KV writes, like the target's verification, are stock: outputs are
exactly the target's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from typing_extensions import override

from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.kv_cache_interface import KVCacheConfig

from vllm_specextend.common.engine_setup import EngineSetup, kept_setup
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.drafters.features import DrafterFeatures
from vllm_specextend.retrieval.owner import DraftRetrieval
from vllm_specextend.retrieval.planner import DraftView
from vllm_specextend.retrieval.repositioning import token_rows


class Overlay:
    """``base`` with some attributes replaced, for one attention metadata build."""

    def __init__(self, base: Any, **replaced: Any) -> None:
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


class MRV2Overrides(DrafterFeatures):
    """Mixin for an MRV2 speculator subclass: put it first."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        setup: EngineSetup | None = None,
    ):
        super().__init__(vllm_config, device)
        self.requests = RequestSlots(self.max_num_reqs)
        self.retrieval = DraftRetrieval(
            # Handed over by the runner's init_speculator (patches/); else
            # the one construction kept for the config.
            setup if setup is not None else kept_setup(vllm_config),
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            # A draft model's step 0 adds a correction token per row.
            max_num_tokens=self.max_num_tokens + self.max_num_reqs,
            dtype=self.dtype,
            device=device,
            requests=self.requests,
        )
        self._draft_view: DraftView | None = None
        # What the draft's attention reads, staged every step. One extra
        # zero: the row of padding tokens.
        self._removed_tokens_by_row = torch.zeros(
            self.max_num_reqs + 1, dtype=torch.int32, device=device
        )
        self._removed_tokens = self._removed_tokens_by_row[: self.max_num_reqs]
        self._compact_seq_lens = torch.zeros(
            self.max_num_reqs, dtype=torch.int32, device=device
        )
        self._compact_block_table: torch.Tensor | None = None
        self._compact_block_tables: list[torch.Tensor] = []
        # Rows of this step (graphs capture the whole buffer, which MRV2's
        # kernels pad in order).
        self._num_rows = self.max_num_reqs

    # ---- set-up -----------------------------------------------------------

    @override
    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        self.retrieval.attach(
            get_layers_from_vllm_config(self.vllm_config, Attention),
            set(self.draft_attn_layer_names),
        )

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
        self.retrieval.bind_kv_cache(
            kv_cache_config, block_tables.block_sizes[gid], getattr(self, "model", None)
        )
        self._compact_block_table = torch.zeros_like(block_tables.input_block_tables[gid])
        self._compact_block_tables = list(block_tables.input_block_tables)
        self._compact_block_tables[gid] = self._compact_block_table

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
        view = None
        # vLLM 0.33's skip_drafts steps propose K=0 (the head only keeps its
        # KV in sync): nothing to draft, nothing to plan.
        drafts = kwargs.get("num_speculative_tokens") != 0
        if not dummy_run and drafts:
            batch = self.planning_batch(input_batch, num_rejected)
            self.requests.update(batch.req_ids)  # the slots' one writer
            view = self.retrieval.plan(batch)
        if self._compact_block_table is not None:
            self._activate(view)
        else:
            # profile_run proposes a dummy batch without attention before
            # initialize_kv_cache calls set_attn: nothing to stage yet.
            assert dummy_run, "propose before set_attn outside a dummy run"
        self._num_rows = input_batch.num_reqs
        try:
            return super().propose(
                input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, *args,
                dummy_run=dummy_run, **kwargs,
            )
        finally:
            self._draft_view = None
            self._num_rows = self.max_num_reqs

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
        """Stage ``view`` (None: nothing compacted) in the persistent buffers
        the draft's metadata builds and captured graphs read."""
        assert self._compact_block_table is not None
        self._draft_view = view
        gid = self.retrieval.kv_cache_gid
        self._compact_block_table.copy_(self.block_tables.input_block_tables[gid])
        self._removed_tokens.zero_()
        if view is None:
            return
        num_rows = view.removed_tokens.shape[0]
        self._compact_block_table[:num_rows] = view.block_table
        self._removed_tokens[:num_rows] = view.removed_tokens

    def _refresh_compact_seq_lens(self) -> None:
        """Compacted lengths from the stock ones (which draft steps advance in
        place): one device op over persistent buffers, safe in a graph."""
        torch.sub(self.input_buffers.seq_lens, self._removed_tokens, out=self._compact_seq_lens)

    def _compacted_block_tables(self) -> Overlay:
        """``block_tables`` whose gathered tables are the compacted ones; slot
        mappings still come from the per-request tables (stock)."""
        compact_tables = self._compact_block_tables

        def get_dummy_block_tables(num_reqs: int) -> tuple[torch.Tensor, ...]:
            # Whole tables zeroed: no stale block ids past num_reqs either
            # (vLLM 0.33 tracks such dirty rows in its own tables; ours are
            # restaged whole every step).
            return tuple(table.zero_()[:num_reqs] for table in compact_tables)

        return Overlay(self.block_tables, input_block_tables=compact_tables,
                       get_dummy_block_tables=get_dummy_block_tables)

    def _compacted_input_buffers(self) -> Overlay:
        """``input_buffers`` whose ``seq_lens`` are the compacted ones: for
        metadata builds only (draft steps advance the stock lengths)."""
        return Overlay(self.input_buffers, seq_lens=self._compact_seq_lens)

    @contextlib.contextmanager
    def _reading_compacted(self, input_buffers: bool = True) -> Iterator[None]:
        """Within: ``block_tables`` (and ``input_buffers``) are the compacted overlays.

        Why a swap of the speculator's own attributes: MRV2's metadata builds
        take no buffers as parameters; they read ``self.block_tables`` and
        ``self.input_buffers`` (``vllm/v1/worker/gpu/spec_decode/speculator.py:353-398``
        in ``_build_attn_metadata``, ``target_dependent_ar/speculator.py:541-549``
        in ``_fused_multi_step_decode``)."""
        stock_buffers, stock_tables = self.input_buffers, self.block_tables
        self.block_tables = self._compacted_block_tables()
        if input_buffers:
            self.input_buffers = self._compacted_input_buffers()
        try:
            yield
        finally:
            self.input_buffers, self.block_tables = stock_buffers, stock_tables

    def _draft_positions(self, positions: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The positions the draft runs at. With compact positions: each
        token's original position minus its row's removed tokens, rows read
        from the draft's ``query_start_loc`` (step 0 and the decode steps both
        set it), clamped into the draft's window for padding tokens. Device
        ops on persistent buffers only, so graphs capture them; the plain
        draft KV copy reads the same positions."""
        kv_copy = self.retrieval.kv_copy
        if kv_copy is None:
            return positions[:num_tokens]
        rows = token_rows(self.input_buffers.query_start_loc[: self._num_rows + 1], num_tokens)
        out = kv_copy.token_positions[:num_tokens]
        torch.sub(positions[:num_tokens], self._removed_tokens_by_row[rows], out=out)
        return out.clamp_(0, self.retrieval.draft_window - 1)

    @override
    def _build_attn_metadata(self, *args, **kwargs) -> dict[str, Any] | None:
        self._refresh_compact_seq_lens()
        with self._reading_compacted():
            return super()._build_attn_metadata(*args, **kwargs)

    @override
    def _update_draft_decode_metadata(self, attn_metadata: dict[str, Any], num_reqs: int) -> None:
        # The metadata holds the compacted lengths' buffer; the stock lengths
        # just advanced.
        self._refresh_compact_seq_lens()
        super()._update_draft_decode_metadata(attn_metadata, num_reqs)
