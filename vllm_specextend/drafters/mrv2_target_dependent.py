"""Retrieval for Model Runner V2's target-dependent speculators (EAGLE heads,
MTP layers: vLLM's ``TargetDependentARSpeculator``), on top of the shared MRV2
overrides (``mrv2_overrides.py``).

What differs from a draft model is the first pass and CUDA graphs:

- step 0 runs over the target's own attention metadata, which the runner
  built for the target's block table; ``_prefill`` hands the head a
  compacted build of its layers instead (same tokens, positions and slot
  mappings; the kept blocks and shortened ``seq_lens``);
- a FULL CUDA graph of step 0 bakes the target's metadata in, so a step that
  compacts a row runs its step 0 eagerly (PIECEWISE graphs keep attention
  outside the graph and take the compacted build);
- decode-step graphs are captured over the persistent compacted buffers
  (``_compact_seq_lens``, the compacted block table), which every step
  stages, and the fused path maps the compacted table before replaying
  (the graph managers' methods this takes, :meth:`cudagraph_manager_routes`,
  are rebound by ``patches/drafter_instances.py``);
- with compact positions the forward reads shifted positions from an overlay
  of ``input_buffers``, while MRV2's kernels advance the original ones (slot
  mappings, sampling keys).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

from vllm_specextend.drafters.mrv2_overrides import MRV2Overrides, Overlay


class MRV2TargetDependentOverrides(MRV2Overrides):
    """Mixin for a ``TargetDependentARSpeculator`` subclass: put it first."""

    _step_inputs: tuple[Any, Any, Any, Any] | None = None
    """This step's input batch, target attention metadata, slot mappings and
    multimodal inputs."""

    @override
    def propose(self, input_batch, attn_metadata, slot_mappings, *args, **kwargs):
        self._step_inputs = (input_batch, attn_metadata, slot_mappings,
                             kwargs.get("mm_inputs"))
        try:
            return super().propose(input_batch, attn_metadata, slot_mappings, *args, **kwargs)
        finally:
            self._step_inputs = None

    # ---- step 0 -----------------------------------------------------------

    @override
    def _prefill(self, num_reqs: int, num_tokens: int, attn_metadata, slot_mappings,
                 *args, **kwargs) -> None:
        if self._draft_view is not None and attn_metadata is not None:
            attn_metadata = {**attn_metadata, **self._compacted_first_pass_metadata(num_reqs)}
        return super()._prefill(num_reqs, num_tokens, attn_metadata, slot_mappings,
                                *args, **kwargs)

    def _compacted_first_pass_metadata(self, num_reqs: int) -> dict[str, Any]:
        """The head's layers' metadata for step 0: the target's batch (whose
        query locations, lengths and positions ``prepare_prefill_inputs``
        copied into the draft's buffers) over the compacted view."""
        assert self._step_inputs is not None
        input_batch = self._step_inputs[0]
        # As the target's build: rows still prefilling say so.
        self.draft_is_prefilling[:num_reqs] = torch.from_numpy(
            input_batch.is_prefilling_np[:num_reqs]
        )
        try:
            metadata = self._build_attn_metadata(
                num_reqs=num_reqs,
                batch_desc=BatchExecutionDescriptor(
                    cg_mode=CUDAGraphMode.NONE,
                    num_tokens=input_batch.num_tokens,
                    num_reqs=num_reqs,
                ),
                query_start_loc_np=input_batch.query_start_loc_np,
                seq_lens_cpu_upper_bound=input_batch.seq_lens_cpu_upper_bound,
                step=0,
            )
        finally:
            self.draft_is_prefilling[:num_reqs] = False
        return metadata or {}

    # ---- positions --------------------------------------------------------

    @override
    def _run_model(self, num_tokens: int, *args, **kwargs):
        # The stock forward reads its positions from ``input_buffers``
        # (``target_dependent_ar/speculator.py:376-409``, no parameter); the
        # kernels that advance them keep the original ones.
        if self.retrieval.kv_copy is None:
            return super()._run_model(num_tokens, *args, **kwargs)
        stock_buffers = self.input_buffers
        positions = self._draft_positions(stock_buffers.positions, num_tokens)
        self.input_buffers = Overlay(stock_buffers, positions=positions)
        try:
            return super()._run_model(num_tokens, *args, **kwargs)
        finally:
            self.input_buffers = stock_buffers

    # ---- CUDA graphs ------------------------------------------------------

    def cudagraph_manager_routes(self) -> list[tuple[Any, str, Callable]]:
        """What ``init_cudagraph_manager`` just built must run instead, as
        ``(manager, method name, replacement)``: step-0 graph replays of
        compacted steps run eagerly; decode graphs are captured over the
        compacted buffers. ``patches/drafter_instances.py`` rebinds them
        (and says why a rebinding)."""
        routes: list[tuple[Any, str, Callable]] = []
        prefill, decode = self.prefill_cudagraph_manager, self.decode_cudagraph_manager
        if prefill is not None:
            stock_replay = prefill.run_fullgraph

            def run_step0_graph(batch_desc):
                if self._draft_view is None:
                    return stock_replay(batch_desc)
                # The graph reads the target's metadata: run compacted, eagerly.
                assert self._step_inputs is not None
                input_batch, attn_metadata, slot_mappings, mm_inputs = self._step_inputs
                self._prefill(input_batch.num_reqs, batch_desc.num_tokens, attn_metadata,
                              slot_mappings, num_tokens_across_dp=None, mm_inputs=mm_inputs)

            routes.append((prefill, "run_fullgraph", run_step0_graph))
        if decode is not None:
            stock_capture = decode.capture

            def capture_over_compacted_buffers(forward_fn, model_state, input_buffers,
                                               block_tables, *args, **kwargs):
                # Graphs read the persistent compacted buffers; the captured
                # steps still advance the stock ones.
                return stock_capture(forward_fn, model_state, self._compacted_input_buffers(),
                                     self._compacted_block_tables(), *args, **kwargs)

            routes.append((decode, "capture", capture_over_compacted_buffers))
        return routes

    @override
    def _fused_multi_step_decode(self, *args, **kwargs) -> None:
        # A FULL graph replay maps the gathered block table for its kernels.
        with self._reading_compacted(input_buffers=False):
            return super()._fused_multi_step_decode(*args, **kwargs)
