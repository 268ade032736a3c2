"""The two swaps on one engine's objects, not on vLLM's classes: the
attention impls of the layers retrieval hooks, and the CUDA-graph managers of
an MRV2 head. Our code decides what to swap in (beside what it hooks); this
module performs each swap, at the vLLM seam right after the objects exist,
and names the vLLM lines that force it."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from vllm_specextend.patches.wrapping import wrap_once


def swap_impl_class(layer: torch.nn.Module, hooked: type) -> None:
    """Make ``layer.impl`` a ``hooked`` (a direct subclass of its class, from
    ``retrieval/layer_hooks.py``: the tap's or the plain KV copy's).

    Why a swap: vLLM builds the impl inside ``Attention.__init__``
    (``vllm/model_executor/layers/attention/attention.py:419-420``,
    ``impl_cls = self.attn_backend.get_impl_cls(); self.impl = impl_cls(...)``)
    while the model is constructed, with no hook to choose a class per layer,
    and only model load tells which layer is tapped; a wrapper object instead
    would break vLLM's ``isinstance`` checks on the impl. Per instance: the
    stock layers of other engines in the process are untouched."""
    if type(layer.impl) is not hooked:
        layer.impl.__class__ = hooked


def hook_attention_impls(retrieval: Any) -> None:
    """Give every layer a drafter's ``DraftRetrieval`` hooks the impl class
    it asked for at KV cache set-up (``impl_classes``)."""
    for layer, hooked in retrieval.impl_classes.values():
        swap_impl_class(layer, hooked)


def patch_runner_kv_cache_set_up(module: ModuleType) -> None:
    """After a runner's ``initialize_kv_cache`` (where its drafter binds
    retrieval to the KV cache: the V1 runner calls the drafter's
    ``initialize_attn_backend``, ``vllm/v1/worker/gpu_model_runner.py:6823``;
    Model Runner V2 its ``set_attn``, ``vllm/v1/worker/gpu/model_runner.py:761``),
    before any forward reads the KV cache (warm-up, graph capture, serving):
    the hooked layers' impls get their classes."""

    def make_wrapper(original: Callable) -> Callable:
        def initialize_kv_cache(self, *args, **kwargs):
            original(self, *args, **kwargs)
            drafter = getattr(self, "drafter", None) or getattr(self, "speculator", None)
            retrieval = getattr(drafter, "retrieval", None)
            if retrieval is not None:
                hook_attention_impls(retrieval)

        return initialize_kv_cache

    wrap_once(module.GPUModelRunner, "initialize_kv_cache", make_wrapper)


def route_cudagraph_managers(speculator: Any) -> None:
    """Rebind the methods of an MRV2 head's CUDA-graph managers our adapter
    asks for (``drafters/mrv2_target_dependent.py``,
    ``cudagraph_manager_routes``); a stock speculator asks for none.

    Why rebinding the managers' methods: vLLM builds both managers inside
    ``init_cudagraph_manager``
    (``vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py:91-107``,
    with a graph mode it derives there) and calls ``run_fullgraph`` and
    ``capture`` from ``propose`` and ``capture`` (``:129``, ``:151``, ``:280``),
    passing ``self.input_buffers`` / ``self.block_tables`` to the decode
    capture; no parameter or factory lets a subclass choose the buffers or
    the replay."""
    routes = getattr(speculator, "cudagraph_manager_routes", None)
    if routes is None:
        return
    for manager, name, replacement in routes():
        setattr(manager, name, replacement)


def patch_target_dependent_graphs(module: ModuleType) -> None:
    """Right after ``TargetDependentARSpeculator.init_cudagraph_manager``
    built the managers (called by Model Runner V2 once ``set_attn`` ran,
    ``vllm/v1/worker/gpu/model_runner.py:771``), before any capture."""

    def make_wrapper(original: Callable) -> Callable:
        def init_cudagraph_manager(self, *args, **kwargs):
            original(self, *args, **kwargs)
            route_cudagraph_managers(self)

        return init_cudagraph_manager

    wrap_once(module.TargetDependentARSpeculator, "init_cudagraph_manager", make_wrapper)
