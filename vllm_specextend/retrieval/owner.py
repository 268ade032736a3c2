"""The one object that owns retrieval for a drafter, whatever runner hosts it.

A drafter adapter (``drafters/``) holds a :class:`DraftRetrieval` and calls
it at three points of its life:

- model load (:meth:`~DraftRetrieval.attach`): find the target's last
  attention layer, and size scoring's workspace before vLLM measures memory;
- KV cache set-up (:meth:`~DraftRetrieval.bind_kv_cache`): check the shared
  KV cache group, install the tap (and, with compact positions, the plain
  draft KV copy), size the planner's state; the impl classes that feed them
  (``impl_classes``) are assigned by ``patches/drafter_instances.py`` once
  the runner's KV cache set-up returns;
- every proposal (:meth:`~DraftRetrieval.plan`): plan the draft's view of the
  KV cache and re-position the working caches whose selection changed.

It also answers the worker (memory outside the KV cache, metrics). Goodput control is a feature of its own
(``control/owner.py``), held beside it by the adapter. Adapters only
translate their runner's inputs into a :class:`PlanningBatch` and hand the
view to their attention metadata.
"""

from __future__ import annotations

import torch

from vllm_specextend.common.engine_checks import check_layers_write_kv_through_update
from vllm_specextend.common.engine_setup import EngineSetup, private_layout_blocks
from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.log import plugin_logger
from vllm_specextend.retrieval.draft_kv_copy import (
    DraftKVCopy,
    RepositioningWorkspace,
    install_draft_kv_copy,
    repositioning_capacity,
)
from vllm_specextend.retrieval.layer_hooks import (
    kv_cache_group_of,
    last_target_layer,
    tap_bytes_per_token,
    tap_target_layer,
)
from vllm_specextend.retrieval.planner import DraftView, PrivateLayouts, RetrievalPlanner
from vllm_specextend.retrieval.repositioning import RotaryLayout, working_cache_slots
from vllm_specextend.retrieval.target_tap import TargetAttentionTap

logger = plugin_logger(__name__)


def sum_over_tensor_parallel_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Each rank scores its own heads: the sum makes every rank pick alike."""
    from vllm.distributed import (
        get_tensor_model_parallel_world_size,
        model_parallel_is_initialized,
        tensor_model_parallel_all_reduce,
    )

    if not model_parallel_is_initialized() or get_tensor_model_parallel_world_size() == 1:
        return scores
    return tensor_model_parallel_all_reduce(scores)


class DraftRetrieval:
    """Config, planner, tap, scoring layer, KV cache group and plain draft KV
    copy of one drafter."""

    def __init__(
        self,
        setup: EngineSetup,
        *,
        max_num_reqs: int,
        max_model_len: int,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        requests: RequestSlots | None = None,
    ) -> None:
        """``requests``: the drafter's request slots, shared with goodput
        control (None: the planner's own)."""
        self.setup = setup
        self.max_num_tokens = max_num_tokens
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.device = device
        self.planner = RetrievalPlanner(
            setup.config,
            max_num_reqs=max_num_reqs,
            max_model_len=max_model_len,
            # The K of a step may be smaller (vLLM's K by batch size).
            max_num_speculative_tokens=setup.num_speculative_tokens,
            draft_window=setup.draft_window,
            compact_positions=setup.compact_positions,
            device=device,
            steps_in_flight=setup.steps_in_flight,
            sum_over_ranks=sum_over_tensor_parallel_ranks,
            requests=requests,
        )
        self.target_layer_name: str | None = None
        self.target_layer: torch.nn.Module | None = None
        self.draft_layers: dict[str, torch.nn.Module] = {}
        self.kv_cache_gid = -1
        self.block_size = -1
        self.kv_copy: DraftKVCopy | None = None
        self.impl_classes: dict[str, tuple[torch.nn.Module, type]] = {}
        """Per hooked layer: the layer and the class its ``impl`` needs to feed
        the tap or the plain draft KV copy, set by :meth:`bind_kv_cache`;
        ``patches/drafter_instances.py`` assigns them after the runner's KV
        cache set-up."""
        self.repositioning_workspace: RepositioningWorkspace | None = None
        self.max_num_reqs = max_num_reqs

    @property
    def config(self) -> SpecExtendConfig:
        return self.planner.config

    @property
    def tap(self) -> TargetAttentionTap | None:
        return self.planner.tap

    @property
    def compact_positions(self) -> bool:
        return self.setup.compact_positions

    @property
    def draft_window(self) -> int:
        return self.setup.draft_window

    # ---- set-up -----------------------------------------------------------

    def attach(
        self, attention_layers: dict[str, torch.nn.Module], draft_layer_names: set[str]
    ) -> None:
        """At model load: pick the scoring layer and allocate scoring's
        workspace, before vLLM measures free memory."""
        self.target_layer_name, self.target_layer = last_target_layer(
            attention_layers, draft_layer_names
        )
        self.draft_layers = {
            name: layer for name, layer in attention_layers.items()
            if name in draft_layer_names
        }
        check_layers_write_kv_through_update(
            {self.target_layer_name: self.target_layer, **self.draft_layers})
        self.planner.allocate_scoring_workspace(self.target_layer, self.dtype)
        if self.compact_positions:
            self._allocate_repositioning_workspace()
        logger.info(
            "SpecExtend: scoring with the target's last attention layer %s "
            "(mode=%s, draft positions %s, draft window %d)",
            self.target_layer_name, self.config.mode,
            "compact" if self.compact_positions else "original", self.draft_window,
        )

    def _allocate_repositioning_workspace(self) -> None:
        layer = next(iter(self.draft_layers.values()))
        self.repositioning_workspace = RepositioningWorkspace(
            repositioning_capacity(self.draft_window), layer.num_kv_heads, layer.head_size,
            self.dtype, self.device)
        logger.info("SpecExtend: re-positioning workspace of %.1f MiB (%d tokens per pass)",
                    self.repositioning_workspace.nbytes / 2**20,
                    self.repositioning_workspace.capacity)

    def kv_cache_group(self, kv_cache_config) -> int:
        """The one KV cache group that holds the scoring layer and every
        draft layer (their shared block table)."""
        assert self.target_layer_name is not None
        return kv_cache_group_of(kv_cache_config, self.target_layer_name, set(self.draft_layers))

    def bind_kv_cache(
        self,
        kv_cache_config,
        block_size: int,
        draft_model: torch.nn.Module | None = None,
    ) -> None:
        """At KV cache set-up: tap the scoring layer for every KV slot and,
        with compact positions, copy the draft's KV (its rotary embedding is
        read from ``draft_model``)."""
        assert self.target_layer is not None
        self.kv_cache_gid = self.kv_cache_group(kv_cache_config)
        self.block_size = block_size
        num_slots = kv_cache_config.num_blocks * block_size
        tap, tapped = tap_target_layer(
            self.target_layer, num_slots, self.max_num_tokens, self.dtype, self.device
        )
        self.impl_classes[self.target_layer_name] = (self.target_layer, tapped)
        self.planner.bind_kv_cache(tap, block_size, self._private_layouts(kv_cache_config))
        config = self.config
        logger.info(
            "SpecExtend: %d-token chunks, top %d chunks + %d sink + %d recent tokens",
            self.planner.chunk_size,
            config.resolved_top_k_chunks(self.planner.chunk_size),
            config.sink_tokens,
            config.recent_tokens,
        )
        if self.compact_positions:
            assert draft_model is not None
            self._install_draft_kv_copy(num_slots, draft_rotary_layout(draft_model))

    def _private_layouts(self, kv_cache_config) -> PrivateLayouts | None:
        """The areas the engine core kept out of the scheduler's blocks
        (same formula, same inputs)."""
        areas, per_area = private_layout_blocks(
            self.setup, kv_cache_config.num_blocks, self.block_size, self.max_model_len)
        if not areas:
            if self.setup.private_layouts:
                logger.warning(
                    "SpecExtend: no room for private draft layouts; requests sharing "
                    "cached blocks lay their draft keys out in place")
            return None
        first_block = kv_cache_config.num_blocks - areas * per_area
        logger.info(
            "SpecExtend: private draft layouts for %d requests (prefix caching): %d "
            "blocks of %d tokens from block %d, kept out of the scheduler's pool",
            areas, areas * per_area, self.block_size, first_block)
        return PrivateLayouts(first_block, areas, per_area)

    def bytes_per_kv_token_outside_cache(self) -> int:
        """Memory per KV slot besides vLLM's cache: the tap's key copy and,
        with compact positions, the plain draft KV copy. The worker counts it
        when it sizes the KV cache."""
        assert self.target_layer is not None
        tap_bytes = tap_bytes_per_token(self.target_layer, self.dtype)
        if not self.compact_positions:
            return tap_bytes
        return tap_bytes + self._kv_copy_bytes_per_token()

    def _kv_copy_bytes_per_token(self) -> int:
        layer = next(iter(self.draft_layers.values()))
        return DraftKVCopy.bytes_per_token(
            len(self.draft_layers), layer.num_kv_heads, layer.head_size, self.dtype
        )

    def _install_draft_kv_copy(self, num_slots: int, rotary: RotaryLayout) -> None:
        layer = next(iter(self.draft_layers.values()))
        self.kv_copy = DraftKVCopy(
            layer_names=sorted(self.draft_layers),
            num_slots=num_slots,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_size,
            rotary=rotary,
            max_num_tokens=self.max_num_tokens,
            dtype=self.dtype,
            device=self.device,
            workspace=self.repositioning_workspace,
        )
        copied = install_draft_kv_copy(self.draft_layers, self.kv_copy)
        self.impl_classes.update(
            (name, (self.draft_layers[name], cls)) for name, cls in copied.items())
        bytes_per_token = self._kv_copy_bytes_per_token()
        logger.info(
            "SpecExtend: compact draft positions (window %d); plain draft KV copy "
            "of %d bytes per token, %.2f GiB for %d KV slots",
            self.draft_window, bytes_per_token, bytes_per_token * num_slots / 2**30,
            num_slots,
        )

    # ---- per step ---------------------------------------------------------

    def plan(self, batch: PlanningBatch) -> DraftView | None:
        """The draft's view for this step (None: every row sees everything),
        with the working caches of re-selected rows laid out at their compact
        positions."""
        view = self.planner.plan(batch)
        if view is not None and self.kv_copy is not None:
            kept_table = view.block_table if view.kept_block_table is None else (
                view.kept_block_table)
            for rewrite in view.rewrites:
                self._reposition_working_caches(
                    rewrite.rows, kept_table, view.block_table, view.kept_context_lens,
                    rewrite.max_context_len,
                )
        return view

    def _reposition_working_caches(
        self,
        rows: torch.Tensor,
        kept_table: torch.Tensor,
        draft_table: torch.Tensor,
        context_lens: torch.Tensor,
        max_context_len: int,
    ) -> None:
        """Write the kept context keys of ``rows`` (at most ``max_context_len``
        each), read from the slots of ``kept_table``, at their compact
        positions into the slots of ``draft_table`` (the same, or the
        request's private blocks)."""
        assert self.kv_copy is not None
        length = min(max_context_len, self.draft_window)
        # Rows in groups the workspace holds: index temporaries stay bounded too.
        per_pass = self.kv_copy.workspace.rows_per_pass(length)
        for start in range(0, rows.shape[0], per_pass):
            group = rows[start:start + per_pass]
            sources, valid = working_cache_slots(
                kept_table[group], context_lens[group], length, self.block_size
            )
            targets, _ = working_cache_slots(
                draft_table[group], context_lens[group], length, self.block_size
            )
            positions = torch.arange(length, device=self.device).repeat(group.shape[0])
            self.kv_copy.write_working_cache(
                self.draft_layers, sources.flatten(), targets.flatten(), valid.flatten(),
                positions,
            )

    def metrics_snapshot(self) -> dict[str, object]:
        return self.planner.metrics_snapshot()


def draft_rotary_layout(draft_model: torch.nn.Module) -> RotaryLayout:
    """The draft's rotary embedding: one layout shared by all its layers."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    layouts = [
        RotaryLayout.of_module(module)
        for module in draft_model.modules()
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
