"""An engine's ``spec_extend`` options, resolved and checked once.

Everything that can be refused is refused here, when the engine is built
(``LLM(...)``, ``vllm serve``), before any model loads, with the reason and
the remedy: retrieval never silently turns into plain drafting.

Engine construction (``patches/engine_construction.py``, ``EngineArgs.create_engine_config``)
runs three steps, in this order: :func:`requested_config` checks the user's
options on their own; :func:`adjust_engine_args` / :func:`adjust_vllm_config`
are the only code that changes vLLM's config; :func:`keep_setup` checks the
options against vLLM's config (:func:`resolve_setup`), once, and keeps the
result for the readers of that config. The engine core and worker processes
get the config pickled and keep their copy's set-up once, at their first
construction step; a model runner hands its set-up to the drafter it builds
(``SETUP_ATTRIBUTE``). No reader resolves or raises after construction.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from vllm_specextend.common import engine_checks
from vllm_specextend.common.options import (
    SpecExtendConfig,
    SpecExtendConfigError,
    spec_extend_options,
)
from vllm_specextend.log import plugin_logger

logger = plugin_logger(__name__)

DRAFT_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
"""Speculative methods whose drafter attends to the KV cache retrieval compacts:
a draft model, or an EAGLE head or MTP layer whose attention layer shares the
target's KV cache group."""

SETUP_ATTRIBUTE = "_spec_extend_setup"
"""Where a model runner keeps its engine's resolved :class:`EngineSetup`
for the drafter it builds."""


@dataclass(frozen=True)
class EngineSetup:
    """An engine's ``spec_extend`` options, validated against its vLLM config."""

    config: SpecExtendConfig
    method: str
    """vLLM's speculative method (one of ``DRAFT_METHODS``)."""
    draft_window: int
    """Positions the draft may run at (its ``max_model_len`` after capping)."""
    num_speculative_tokens: int
    """The configured K (a step may draft fewer: vLLM's K by batch size)."""
    compact_positions: bool
    """Requests longer than the draft's window draft at compact positions."""
    steps_in_flight: int
    """Engine steps that may run at once (``max_concurrent_batches``)."""
    private_layouts: bool = False
    """Compact positions with prefix caching: requests re-position their
    draft KV into blocks of their own (:func:`private_layout_blocks`), not
    into cached blocks other requests share."""
    max_num_seqs: int = 0


def resolve_setup(vllm_config: Any) -> EngineSetup | None:
    """The validated set-up of an engine, or None when SpecExtend is off.

    Pure: it reads vLLM's config and changes nothing (``adjust_*`` did
    that before). Called once per engine, by :func:`keep_setup` at its
    construction; readers take the result from :func:`kept_setup`.

    Raises:
        SpecExtendConfigError: options that SpecExtend cannot honour.
    """
    options = spec_extend_options(getattr(vllm_config, "additional_config", None))
    if options is None:
        return None
    config = SpecExtendConfig.from_dict(options)
    if not config.enabled:
        return None
    _note_options(options, config)
    spec = vllm_config.speculative_config
    method = speculative_method(spec)
    _check_drafter(vllm_config, method)
    compact = _check_positions(vllm_config, config)
    _check_features(vllm_config, config, method)
    if config.retrieves and private_layouts_ignored(options, vllm_config, compact):
        logger.warning_once(
            "SpecExtend: option 'private_layouts' has no effect: it applies to compact "
            "draft positions with prefix caching only; ignored.")
    if vllm_config.use_v2_model_runner:
        logger.warning_once(
            "SpecExtend: Model Runner V2 selected; retrieval runs in its SpecExtend "
            "speculators, which are unit-tested on CPU and have run on a GPU only "
            "through stand-ins for vLLM's compiled ops (tests/gpu). Unset "
            "VLLM_USE_V2_MODEL_RUNNER for the V1 runner."
        )
    return EngineSetup(
        config=config,
        method=method,
        draft_window=draft_window(vllm_config),
        num_speculative_tokens=spec.num_speculative_tokens,
        compact_positions=compact,
        steps_in_flight=vllm_config.max_concurrent_batches,
        private_layouts=(compact and config.private_layouts
                         and bool(vllm_config.cache_config.enable_prefix_caching)),
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
    )


def _check_drafter(vllm_config: Any, method: str | None) -> None:
    """Refuse a drafter or models SpecExtend cannot serve."""
    spec = vllm_config.speculative_config
    if method not in DRAFT_METHODS:
        raise SpecExtendConfigError(
            "spec_extend needs speculative decoding whose drafter attends to the KV "
            f"cache: speculative_config method one of {list(DRAFT_METHODS)}, e.g. "
            "{'method': 'draft_model', 'model': DRAFT, 'num_speculative_tokens': K} "
            f"(got method={method!r})"
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
        engine_checks.check_full_attention(role, model_config)
    engine_checks.check_kv_cache_reaches_tap(vllm_config)
    engine_checks.check_micro_batching(vllm_config)
    if method == "eagle3":
        engine_checks.check_eagle3_aux_layers(vllm_config)
    if method == "mtp":
        engine_checks.check_mtp(spec, vllm_config.use_v2_model_runner)


def _check_positions(vllm_config: Any, config: SpecExtendConfig) -> bool:
    """Refuse draft positions, chunks or a working cache that do not fit;
    whether drafting runs at compact positions."""
    block_size = vllm_config.cache_config.block_size
    config.check_draft_positions(draft_window(vllm_config), vllm_config.model_config.max_model_len)
    compact = uses_compact_positions(vllm_config, config)
    if block_size is not None:
        config.check_chunk_size(block_size)
        if compact:
            _check_compact_positions(vllm_config, config, block_size)
    if compact and not config.retrieves:
        raise SpecExtendConfigError(
            "spec_extend with mode='off' cannot draft requests longer than the "
            f"draft's window ({draft_window(vllm_config)} positions; the target's "
            f"max_model_len is {vllm_config.model_config.max_model_len}): compact "
            "draft positions need retrieval. Use mode 'cmr' or 'streaming', or a "
            "draft window as long as the target's."
        )
    return compact


def _check_features(vllm_config: Any, config: SpecExtendConfig, method: str) -> None:
    """Refuse goodput control or retrieval options the engine cannot run."""
    if config.controls_speculation:
        engine_checks.check_speculation_control(vllm_config)
        if vllm_config.device_config.device_type == "cuda":
            logger.warning_once(
                "SpecExtend: speculation_control='goodput' runs vLLM's V1 model runner "
                "with the synchronous scheduler; on an H200 these alone decoded at "
                "0.82-0.89x vLLM's defaults (Model Runner V2, async scheduling) with an "
                "8B-shaped target, so goodput control does not hold its floor on GPUs "
                "yet (benchmarks/results/gpu-goodput-floor).")
    if config.retrieves and config.retrieval_refresh == "acceptance":
        engine_checks.check_acceptance_refresh(vllm_config)
    if config.retrieves and vllm_config.use_v2_model_runner:
        engine_checks.check_mrv2_adaptive_verification(vllm_config)
        if method != "draft_model":
            engine_checks.check_mrv2_data_parallel(vllm_config)


_KEPT_SETUPS: dict[int, EngineSetup | None] = {}
"""Resolved set-ups by ``id`` of their live ``VllmConfig``, in this process."""


def keep_setup(vllm_config: Any) -> EngineSetup | None:
    """Resolve the engine's set-up (:func:`resolve_setup`) once per config
    and process, where the config is built, and keep it for the readers of
    that config; the kept one when there is one. Raises what
    :func:`resolve_setup` raises.

    Called only where an engine is constructed: by the front end in
    ``EngineArgs.create_engine_config`` (any bad input is refused there),
    and, since vLLM pickles the config into the engine core and worker
    processes, by their first construction step for their copy (the engine
    core's KV cache set-up, each model runner's ``__init__``): the same
    inputs give the same set-up. Readers after construction take the kept
    one (:func:`kept_setup`), or the one a runner was handed.

    Kept beside the config, not on it: vLLM's ``config.utils.replace`` (a
    drafter's config is one) refuses attributes that are not fields, and
    ``additional_config`` is hashed as JSON."""
    key = id(vllm_config)
    if key not in _KEPT_SETUPS:
        _KEPT_SETUPS[key] = resolve_setup(vllm_config)
        weakref.finalize(vllm_config, _KEPT_SETUPS.pop, key, None)
    return _KEPT_SETUPS[key]


def is_kept(vllm_config: Any) -> bool:
    """Whether construction has resolved ``vllm_config``'s set-up in this process."""
    return id(vllm_config) in _KEPT_SETUPS


def kept_setup(vllm_config: Any) -> EngineSetup | None:
    """The set-up :func:`keep_setup` kept for ``vllm_config`` (None:
    SpecExtend is off). A read: it never resolves, so it never raises for a
    config construction has been through."""
    return _KEPT_SETUPS[id(vllm_config)]


def full_decode_graph_query_len(vllm_config: Any) -> int | None:
    """``1 + K`` when the V1 runner replays FULL CUDA graphs for uniform
    decode batches (``cudagraph_mode`` FULL_DECODE_ONLY or FULL_AND_PIECEWISE,
    vLLM's GPU default): its dispatcher takes a batch as one only when every
    request verifies ``1 + K`` tokens; any other decode batch runs PIECEWISE
    (or eagerly). None otherwise (FULL for every batch, PIECEWISE, none).

    Read it once vLLM has settled the mode, not when the engine is built: the
    V1 runner resolves it against its attention backends
    (``GPUModelRunner.initialize_attn_backend``; FULL may become
    FULL_DECODE_ONLY or FULL_AND_PIECEWISE, FULL decode graphs NONE or
    PIECEWISE), after it has built the drafter."""
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if mode is None or mode.decode_mode().name != "FULL" or not mode.separate_routine():
        return None
    return 1 + vllm_config.speculative_config.num_speculative_tokens


PRIVATE_LAYOUT_SHARE = 0.25
"""Most of the KV cache's blocks that private layouts may take."""


def private_layout_blocks(
    setup: EngineSetup, num_blocks: int, block_size: int, max_model_len: int
) -> tuple[int, int]:
    """``(areas, blocks per area)`` kept out of the scheduler's block pool at
    the end of the KV cache, for requests' private draft layouts.

    With prefix caching, requests on one document share its cached blocks;
    re-positioning their draft keys in place would leave each shared block
    with the last request's layout. A request with an area writes its
    working cache there instead (one draft window of blocks). Areas: one per
    running request (``max_num_seqs``), within ``PRIVATE_LAYOUT_SHARE`` of
    the blocks and leaving a whole ``max_model_len`` request room; a request
    beyond them lays out in place (``layouts_in_place`` in the metrics).
    The engine core (scheduler) and the workers compute the same figures.
    """
    if not setup.private_layouts:
        return 0, 0
    per_area = -(-setup.draft_window // block_size)
    budget = min(int(num_blocks * PRIVATE_LAYOUT_SHARE),
                 num_blocks - 1 - -(-max_model_len // block_size))
    return max(0, min(setup.max_num_seqs, budget // per_area)), per_area


def speculative_method(spec: Any) -> str | None:
    """vLLM's speculative method, ``draft_model`` for a draft model."""
    if spec is None:
        return None
    return "draft_model" if spec.uses_draft_model() else spec.method


def needs_synchronous_scheduler(config: SpecExtendConfig) -> bool:
    """Whether the options read each step's accepted drafts on the host
    (goodput control, acceptance-driven refresh)."""
    refreshes_on_acceptance = config.retrieves and config.retrieval_refresh == "acceptance"
    return config.controls_speculation or refreshes_on_acceptance


RETRIEVAL_ONLY_OPTIONS = (
    "chunk_size", "top_k_chunks", "sink_tokens", "recent_tokens", "retrieval_interval",
    "retrieval_refresh", "acceptance_drop", "min_context_tokens", "score_aggregation",
    "private_layouts",
)
"""Options that shape retrieval: meaningless with ``mode='off'``."""


def meaningless_options(options: dict[str, Any], config: SpecExtendConfig) -> dict[str, str]:
    """The options the user set that another setting makes meaningless, each
    with the reason."""
    ignored: dict[str, str] = {}
    if "goodput_warm_up" in options and not config.controls_speculation:
        ignored["goodput_warm_up"] = "speculation_control='off' has no warm-up"
    if not config.retrieves:
        for name in RETRIEVAL_ONLY_OPTIONS:
            if name in options:
                ignored[name] = "mode='off' retrieves nothing"
        return ignored
    if "acceptance_drop" in options and config.retrieval_refresh != "acceptance":
        ignored["acceptance_drop"] = (
            f"retrieval_refresh={config.retrieval_refresh!r} retrieves every "
            "retrieval_interval steps (set retrieval_refresh='acceptance' to use it)")
    if "score_aggregation" in options and config.mode != "cmr":
        ignored["score_aggregation"] = f"mode={config.mode!r} keeps blocks without scores"
    return ignored


def private_layouts_ignored(options: dict[str, Any], vllm_config: Any,
                            compact_positions: bool) -> bool:
    """Whether the user set ``private_layouts`` (in ``options``, validated)
    where it changes nothing."""
    if "private_layouts" not in options:
        return False
    return not (compact_positions and vllm_config.cache_config.enable_prefix_caching)


def _note_options(options: dict[str, Any], config: SpecExtendConfig) -> None:
    """Say what an empty ``spec_extend`` does, and warn of options that
    another setting makes meaningless (once per process)."""
    if not options:
        logger.info_once(
            "SpecExtend: no spec_extend options given: the defaults apply "
            "(mode=%r, speculation_control=%r)", config.mode, config.speculation_control)
    for name, reason in meaningless_options(options, config).items():
        logger.warning_once(
            "SpecExtend: option %r has no effect: %s; ignored.", name, reason)


def requested_config(additional_config: Any) -> SpecExtendConfig | None:
    """The user's options, checked on their own (before vLLM's config
    exists); None without ``spec_extend`` or with both features off.

    Raises:
        SpecExtendConfigError: an unknown option or an invalid value.
    """
    options = spec_extend_options(additional_config)
    if options is None:
        return None
    config = SpecExtendConfig.from_dict(options)
    return config if config.enabled else None


def requests_spec_extend(vllm_config: Any) -> bool:
    """Whether the engine asks for SpecExtend on a drafter it serves (the
    options checked on their own; against vLLM's config by :func:`resolve_setup`)."""
    config = requested_config(getattr(vllm_config, "additional_config", None))
    return (config is not None
            and speculative_method(vllm_config.speculative_config) in DRAFT_METHODS)


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


def adjust_engine_args(engine_args: Any, config: SpecExtendConfig) -> None:
    """Before vLLM builds its config: with goodput control or
    ``retrieval_refresh='acceptance'`` and no user ``async_scheduling``,
    select the synchronous scheduler (both read each step's accepted drafts
    on the host, which the async scheduler knows a step late)."""
    if engine_args.async_scheduling is None and needs_synchronous_scheduler(config):
        engine_args.async_scheduling = False


def adjust_vllm_config(
    vllm_config: Any, config: SpecExtendConfig, user_chunk_budget: int | None
) -> None:
    """After vLLM built its config, before :func:`resolve_setup` checks it:
    with compact draft positions and no ``max_num_batched_tokens`` from the
    user, schedule prompt chunks of at most half the draft's window, so the
    other half holds the most recent context while the draft prefills them."""
    block_size = vllm_config.cache_config.block_size
    if (user_chunk_budget is not None or block_size is None
            or speculative_method(vllm_config.speculative_config) not in DRAFT_METHODS
            or not uses_compact_positions(vllm_config, config)):
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
