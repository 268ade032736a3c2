"""The one seam between SpecExtend and vLLM.

vLLM entry points are wrapped, each once and only when vLLM imports its
module (so a front-end process never imports the model runner for us):

- ``EngineArgs.create_engine_config``: validates ``spec_extend`` options when
  the engine (``LLM(...)``, ``vllm serve``) is constructed, before any model
  is loaded, and refuses configurations where retrieval could not run.
- ``VllmConfig.use_v2_model_runner``: an engine with ``spec_extend`` and no
  ``VLLM_USE_V2_MODEL_RUNNER`` in the environment runs vLLM's V1 model runner
  (retrieval in Model Runner V2 has not been run on a GPU yet); ``=1`` gets
  the MRV2 seam below, with a warning.
- ``GPUModelRunner.__init__`` of the V1 runner (the CPU runner is its
  subclass): while a runner with ``spec_extend`` is built, the runner
  module's ``DraftModelProposer`` name points to :class:`SpecExtendProposer`;
  it is restored right after, so the stock class is untouched and
  ``isinstance`` checks keep working. That runner's batch-wide
  ``_input_fits_in_drafter`` gate is replaced: every row drafts. The worker
  gains ``spec_extend_metrics`` for ``collective_rpc``.
- ``GPUModelRunner.__init__`` of Model Runner V2: the same, with its module's
  ``init_speculator`` returning :class:`SpecExtendARSpeculator`.
- With compact draft positions and no user ``max_num_batched_tokens``, the
  engine config's prompt chunks are capped at half the draft's window.
- ``LLMEngine.get_metrics`` and ``AsyncLLM.do_log_stats``: pull the retrieval
  figures from the worker into Prometheus first (see ``metrics.py``).
- ``Worker``/``CPUWorker.determine_available_memory``: the share of the tap's
  key copy (and, with compact draft positions, of the plain draft KV copy) is
  taken off the memory reported for the KV cache, so vLLM sizes the cache with
  them counted.

Without ``spec_extend`` options every wrapper calls straight through.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_specextend import plugin_logger
from vllm_specextend.config import (
    SpecExtendConfig,
    SpecExtendConfigError,
    spec_extend_options,
)

ENGINE_ARGS_MODULE = "vllm.engine.arg_utils"
VLLM_CONFIG_MODULE = "vllm.config.vllm"
MODEL_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
MODEL_RUNNER_V2_MODULE = "vllm.v1.worker.gpu.model_runner"
LLM_ENGINE_MODULE = "vllm.v1.engine.llm_engine"
ASYNC_LLM_MODULE = "vllm.v1.engine.async_llm"
WORKER_CLASSES = {"vllm.v1.worker.gpu_worker": "Worker", "vllm.v1.worker.cpu_worker": "CPUWorker"}
_PATCHED_MARK = "_specextend_wrapped"
logger = plugin_logger(__name__)


def spec_extend_config(vllm_config: Any) -> SpecExtendConfig | None:
    """The validated options of an engine, or None when retrieval is off.

    Raises:
        SpecExtendConfigError: options that retrieval cannot honour.
    """
    options = spec_extend_options(getattr(vllm_config, "additional_config", None))
    if options is None:
        return None
    config = SpecExtendConfig.from_dict(options)
    if not config.enabled:
        return None
    spec = vllm_config.speculative_config
    if spec is None or not spec.uses_draft_model():
        method = None if spec is None else spec.method
        raise SpecExtendConfigError(
            "spec_extend needs draft-model speculative decoding: pass "
            "speculative_config={'method': 'draft_model', 'model': DRAFT, "
            f"'num_speculative_tokens': K}} (got method={method!r})"
        )
    if spec.parallel_drafting:
        raise SpecExtendConfigError(
            "spec_extend does not support parallel_drafting=True in "
            "speculative_config; remove it"
        )
    for role, model_config in (
        ("target", vllm_config.model_config),
        ("draft", spec.draft_model_config),
    ):
        _check_full_attention(role, model_config)
    _check_kv_cache_reaches_tap(vllm_config)
    block_size = vllm_config.cache_config.block_size
    compact = uses_compact_positions(vllm_config, config)
    if block_size is not None:
        config.resolved_chunk_size(block_size)
        if compact:
            _check_compact_positions(vllm_config, config, block_size)
    if vllm_config.use_v2_model_runner:
        if compact:
            raise SpecExtendConfigError(
                "spec_extend's compact draft positions (a draft window of "
                f"{draft_window(vllm_config)} positions for a target max_model_len of "
                f"{vllm_config.model_config.max_model_len}) run in vLLM's V1 model "
                "runner only, but this engine selected Model Runner V2. Unset "
                "VLLM_USE_V2_MODEL_RUNNER (or set it to 0)."
            )
        logger.warning_once(
            "SpecExtend: Model Runner V2 selected; retrieval runs in "
            "SpecExtendARSpeculator, which is unit-tested on CPU but has not been "
            "run on a GPU yet. Unset VLLM_USE_V2_MODEL_RUNNER for the V1 runner."
        )
    return config


def draft_window(vllm_config: Any) -> int:
    """Positions the draft may run at: its ``max_model_len`` after vLLM's
    capping (``speculative_config["max_model_len"]`` included)."""
    return vllm_config.speculative_config.draft_model_config.max_model_len


def uses_compact_positions(vllm_config: Any, config: SpecExtendConfig) -> bool:
    return config.uses_compact_positions(
        draft_window(vllm_config), vllm_config.model_config.max_model_len
    )


def _check_compact_positions(
    vllm_config: Any, config: SpecExtendConfig, block_size: int
) -> None:
    spec = vllm_config.speculative_config
    window = draft_window(vllm_config)
    k = spec.num_speculative_tokens
    config.check_working_cache_fits(window, block_size, k)
    if spec.draft_model_config.uses_mrope:
        raise SpecExtendConfigError(
            "spec_extend's compact draft positions need a draft with plain rotary "
            "positions; this draft uses M-RoPE. Set draft_positions='original' and "
            "a draft window as long as the target's."
        )
    scheduler = vllm_config.scheduler_config
    limit = config.prefill_chunk_limit(window, block_size, k)
    if not scheduler.enable_chunked_prefill:
        raise SpecExtendConfigError(
            "spec_extend's compact draft positions prefill long prompts in chunks "
            f"of at most {limit} tokens (the draft's window is {window}); enable "
            "chunked prefill."
        )
    if scheduler.max_num_batched_tokens > limit:
        raise SpecExtendConfigError(
            f"max_num_batched_tokens={scheduler.max_num_batched_tokens} lets vLLM "
            f"schedule prompt chunks longer than the draft can prefill inside its "
            f"window of {window} positions (at most {limit} tokens with "
            f"sink_tokens={config.sink_tokens}, num_speculative_tokens={k} and "
            f"{block_size}-token blocks). Set max_num_batched_tokens <= {limit}, "
            "or leave it unset to get half the draft's window."
        )


def fit_prefill_chunks_to_draft_window(
    vllm_config: Any, config: SpecExtendConfig, user_chunk_budget: int | None
) -> None:
    """With compact draft positions and no ``max_num_batched_tokens`` from the
    user, schedule prompt chunks of at most half the draft's window, so the
    other half holds the most recent context while the draft prefills them."""
    block_size = vllm_config.cache_config.block_size
    if user_chunk_budget is not None or block_size is None:
        return
    if not uses_compact_positions(vllm_config, config):
        return
    scheduler = vllm_config.scheduler_config
    window = draft_window(vllm_config)
    half_window = max(block_size, window // 2 // block_size * block_size)
    budget = max(scheduler.max_num_seqs, half_window)
    if scheduler.max_num_batched_tokens > budget:
        logger.info(
            "SpecExtend: max_num_batched_tokens %d -> %d (half the draft's window "
            "of %d positions) so the draft prefills long prompts inside its window",
            scheduler.max_num_batched_tokens, budget, window,
        )
        scheduler.max_num_batched_tokens = budget
        scheduler.max_num_encoder_input_tokens = budget
        scheduler.encoder_cache_size = budget


_UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "half", "float", "float32")


def _check_kv_cache_reaches_tap(vllm_config: Any) -> None:
    """Refuse set-ups where the tapped keys and queries would not match the KV
    cache the draft reads: retrieval would pick chunks from wrong scores."""
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, name, 1)
        if size > 1:
            raise SpecExtendConfigError(
                f"spec_extend does not support {name}={size}: context parallelism "
                "interleaves each request's KV cache over ranks, which block-table "
                f"compaction does not follow. Use {name}=1."
            )
    if vllm_config.kv_transfer_config is not None:
        raise SpecExtendConfigError(
            "spec_extend does not support KV connectors or KV offloading "
            "(kv_transfer_config / kv_offloading_size): they load KV blocks without "
            "the attention layers' do_kv_cache_update, so the target's keys never "
            "reach retrieval. Remove the KV connector, or spec_extend."
        )
    spec = vllm_config.speculative_config
    for option, dtype in (
        ("kv_cache_dtype", vllm_config.cache_config.cache_dtype),
        ('speculative_config["kv_cache_dtype"]', spec.kv_cache_dtype),
    ):
        if dtype is not None and dtype not in _UNQUANTIZED_KV_CACHE_DTYPES:
            raise SpecExtendConfigError(
                f"spec_extend does not support {option}={dtype!r}: retrieval scores "
                "with the target's queries and keys as the attention layer sees them, "
                "and a quantized KV cache hands it scaled values. Use "
                f"{option}='auto'."
            )


def _check_full_attention(role: str, model_config: Any) -> None:
    """Refuse models whose KV cache is not one full-attention block table."""
    if model_config is None:
        return
    if model_config.is_hybrid or model_config.is_attention_free:
        kind = "hybrid or attention-free layers (state-space / linear attention)"
    elif model_config.get_sliding_window() is not None:
        kind = f"sliding-window attention (sliding_window={model_config.get_sliding_window()})"
    else:
        return
    raise SpecExtendConfigError(
        f"spec_extend rewrites one full-attention block table shared by target and "
        f"draft, but the {role} model {model_config.model} uses {kind}, whose KV "
        "cache it cannot compact. Use full-attention models, or remove spec_extend."
    )


def install() -> None:
    """Wrap vLLM's entry points once their modules are imported (idempotent)."""
    when_imported(ENGINE_ARGS_MODULE, _wrap_create_engine_config)
    when_imported(VLLM_CONFIG_MODULE, _wrap_use_v2_model_runner)
    when_imported(MODEL_RUNNER_MODULE, _wrap_model_runner_init)
    when_imported(MODEL_RUNNER_V2_MODULE, _wrap_model_runner_v2_init)
    when_imported(LLM_ENGINE_MODULE, _wrap_llm_engine_get_metrics)
    when_imported(ASYNC_LLM_MODULE, _wrap_async_llm_do_log_stats)
    for module_name, class_name in WORKER_CLASSES.items():
        when_imported(module_name, functools.partial(_wrap_worker_memory, class_name=class_name))


def install_version_guard(message: str) -> None:
    """On an unsupported vLLM: patch nothing, but refuse ``spec_extend``."""

    def guard(module: ModuleType) -> None:
        def check(vllm_config: Any, user_chunk_budget: int | None) -> None:
            options = spec_extend_options(getattr(vllm_config, "additional_config", None))
            if options is not None:
                raise SpecExtendConfigError(message)

        _wrap_engine_args(module, check)

    when_imported(ENGINE_ARGS_MODULE, guard)


def _wrap_create_engine_config(module: ModuleType) -> None:
    def check(vllm_config: Any, user_chunk_budget: int | None) -> None:
        if _requests_spec_extend(vllm_config):
            options = spec_extend_options(vllm_config.additional_config)
            fit_prefill_chunks_to_draft_window(
                vllm_config, SpecExtendConfig.from_dict(options), user_chunk_budget
            )
        spec_extend_config(vllm_config)

    _wrap_engine_args(module, check)


def _wrap_engine_args(module: ModuleType, check: Callable[[Any, int | None], Any]) -> None:
    engine_args = module.EngineArgs
    original = engine_args.create_engine_config
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        user_chunk_budget = self.max_num_batched_tokens
        vllm_config = original(self, *args, **kwargs)
        check(vllm_config, user_chunk_budget)
        return vllm_config

    setattr(create_engine_config, _PATCHED_MARK, True)
    engine_args.create_engine_config = create_engine_config


def _wrap_model_runner_init(module: ModuleType) -> None:
    def proposer(stock: type) -> type:
        from vllm_specextend.cpu_rejection_sampling import patch_cpu_rejection_sampler
        from vllm_specextend.specextend_proposer import SpecExtendProposer

        patch_cpu_rejection_sampler()
        return SpecExtendProposer

    def every_row_drafts(runner: Any) -> None:
        # vLLM switches drafting off for the whole batch when its longest
        # request does not fit the draft's window; our proposer drafts every
        # row inside the window (compact positions), so every row drafts.
        runner._input_fits_in_drafter = _every_row_drafts

    _swap_while_runner_is_built(module, "DraftModelProposer", proposer, every_row_drafts)


def _swap_while_runner_is_built(
    module: ModuleType,
    name: str,
    replacement: Callable[[Any], Any],
    after_init: Callable[[Any], None] | None = None,
) -> None:
    """While a ``module.GPUModelRunner`` with ``spec_extend`` is built, the
    module's ``name`` is ``replacement(stock)``; it is restored right after,
    so the stock object is untouched and ``isinstance`` checks keep working."""
    runner_cls = module.GPUModelRunner
    original = runner_cls.__init__
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        if spec_extend_config(vllm_config) is None:
            return original(self, vllm_config, *args, **kwargs)
        _add_worker_metrics_method()
        stock = getattr(module, name)
        setattr(module, name, replacement(stock))
        try:
            original(self, vllm_config, *args, **kwargs)
        finally:
            setattr(module, name, stock)
        if after_init is not None:
            after_init(self)

    setattr(__init__, _PATCHED_MARK, True)
    runner_cls.__init__ = __init__


def _wrap_use_v2_model_runner(module: ModuleType) -> None:
    config_cls = module.VllmConfig
    stock = config_cls.use_v2_model_runner
    if getattr(stock.fget, _PATCHED_MARK, False):
        return

    @functools.wraps(stock.fget)
    def use_v2_model_runner(self) -> bool:
        chosen = stock.fget(self)
        if module.envs.VLLM_USE_V2_MODEL_RUNNER is not None or not _requests_spec_extend(self):
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
            "(SpecExtendARSpeculator, not yet run on a GPU)."
        )
        return False

    setattr(use_v2_model_runner, _PATCHED_MARK, True)
    config_cls.use_v2_model_runner = property(use_v2_model_runner)


def _requests_spec_extend(vllm_config: Any) -> bool:
    """Whether the engine asks for retrieval (options are validated later)."""
    options = spec_extend_options(getattr(vllm_config, "additional_config", None))
    spec = vllm_config.speculative_config
    if options is None or spec is None or not spec.uses_draft_model():
        return False
    try:
        return SpecExtendConfig.from_dict(options).enabled
    except SpecExtendConfigError:
        return False


def _wrap_model_runner_v2_init(module: ModuleType) -> None:
    def speculator_factory(stock: Callable) -> Callable:
        from vllm_specextend.specextend_ar_speculator import SpecExtendARSpeculator

        def init_speculator(vllm_config, device, req_states):
            return SpecExtendARSpeculator(vllm_config, device)

        return init_speculator

    _swap_while_runner_is_built(module, "init_speculator", speculator_factory)


def _wrap_worker_memory(module: ModuleType, class_name: str) -> None:
    worker_cls = getattr(module, class_name)
    original = worker_cls.determine_available_memory
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    def determine_available_memory(self):
        available = original(self)
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
        extra_per_token = getattr(drafter, "bytes_per_kv_token_outside_cache", None)
        if extra_per_token is None:
            return available
        extra = extra_per_token()
        cache = sum(
            spec.page_size_bytes / spec.block_size
            for spec in runner.get_kv_cache_spec().values()
        )
        share = extra / (cache + extra)
        logger.info(
            "SpecExtend: %.1f%% of the %.2f GiB KV cache budget goes to retrieval's "
            "copies (%d bytes per KV slot: the tap's keys%s)", 100 * share,
            available / 2**30, extra,
            ", the plain draft KV copy" if getattr(drafter, "compact_positions", False) else "",
        )
        return int(available * (1 - share))

    setattr(determine_available_memory, _PATCHED_MARK, True)
    worker_cls.determine_available_memory = determine_available_memory


def _every_row_drafts(common_attn_metadata: Any) -> bool:
    return common_attn_metadata is not None


def _add_worker_metrics_method() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    from vllm_specextend.metrics import WORKER_METHOD, worker_metrics

    if not hasattr(WorkerBase, WORKER_METHOD):
        setattr(WorkerBase, WORKER_METHOD, worker_metrics)


def _wrap_llm_engine_get_metrics(module: ModuleType) -> None:
    engine_cls = module.LLMEngine
    original = engine_cls.get_metrics
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    def get_metrics(self):
        if spec_extend_config(self.vllm_config) is not None:
            from vllm_specextend import metrics

            metrics.publish(self.vllm_config, self.collective_rpc(metrics.WORKER_METHOD))
        return original(self)

    setattr(get_metrics, _PATCHED_MARK, True)
    engine_cls.get_metrics = get_metrics


def _wrap_async_llm_do_log_stats(module: ModuleType) -> None:
    engine_cls = module.AsyncLLM
    original = engine_cls.do_log_stats
    if getattr(original, _PATCHED_MARK, False):
        return

    @functools.wraps(original)
    async def do_log_stats(self):
        if spec_extend_config(self.vllm_config) is not None and not self.errored:
            from vllm_specextend import metrics

            metrics.publish(self.vllm_config, await self.collective_rpc(metrics.WORKER_METHOD))
        await original(self)

    setattr(do_log_stats, _PATCHED_MARK, True)
    engine_cls.do_log_stats = do_log_stats


# ---- post-import hooks ----------------------------------------------------


def when_imported(module_name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` now if the module is imported, else right after."""
    module = sys.modules.get(module_name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        if not getattr(module.__spec__, "_initializing", False):
            hook(module)
            return
    _finder().add(module_name, hook)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable[[ModuleType], None]]] = {}

    def add(self, module_name: str, hook: Callable[[ModuleType], None]) -> None:
        hooks = self.hooks.setdefault(module_name, [])
        if hook not in hooks:
            hooks.append(hook)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.hooks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, self.hooks.pop(fullname))
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hooks: list[Callable[[ModuleType], None]]) -> None:
        self._loader = loader
        self._hooks = hooks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for hook in self._hooks:
            hook(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _finder() -> _PostImportFinder:
    for finder in sys.meta_path:
        if isinstance(finder, _PostImportFinder):
            return finder
    finder = _PostImportFinder()
    sys.meta_path.insert(0, finder)
    return finder
