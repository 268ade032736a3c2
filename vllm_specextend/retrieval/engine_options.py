"""An engine's ``spec_extend`` options, resolved and checked once.

Everything that can be refused is refused here, when the engine is built
(``LLM(...)``, ``vllm serve``), before any model loads, with the reason and
the remedy: retrieval never silently turns into plain drafting.

Engine construction (``patches.py``, ``EngineArgs.create_engine_config``)
runs three steps, in this order: :func:`requested_config` checks the user's
options on their own; :func:`adjust_engine_args` / :func:`adjust_vllm_config`
are the only code that changes vLLM's config; :func:`kept_setup` checks the
options against vLLM's config (:func:`resolve_setup`) and keeps the result
for every reader of that config.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from vllm_specextend.core.options import (
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
"""Where a model runner keeps its engine's resolved :class:`RetrievalSetup`
for the drafter it builds."""


@dataclass(frozen=True)
class RetrievalSetup:
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
    full_graph_query_len: int | None = None
    """Query length of every request in a decode step that replays the
    target's FULL CUDA graphs (``1 + K``, vLLM's FULL decode graphs); None:
    no FULL decode graphs (CPU, eager, PIECEWISE only)."""


def resolve_setup(vllm_config: Any) -> RetrievalSetup | None:
    """The validated retrieval set-up of an engine, or None when it is off.

    Pure: it reads vLLM's config and changes nothing (``adjust_*`` did
    that before). Readers call :func:`kept_setup`, which calls this once
    per engine, at its construction.

    Raises:
        SpecExtendConfigError: options that retrieval cannot honour.
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
        _check_full_attention(role, model_config)
    _check_kv_cache_reaches_tap(vllm_config)
    _check_micro_batching(vllm_config)
    if method == "eagle3":
        _check_eagle3_aux_layers(vllm_config)
    if method == "mtp":
        _check_mtp(spec, vllm_config.use_v2_model_runner)
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
    if config.controls_speculation:
        _check_speculation_control(vllm_config)
    if config.retrieves and config.retrieval_refresh == "acceptance":
        _check_acceptance_refresh(vllm_config)
    if config.retrieves and vllm_config.use_v2_model_runner and method != "draft_model":
        _check_mrv2_data_parallel(vllm_config)
    if config.retrieves and private_layouts_ignored(options, vllm_config, compact):
        logger.warning_once(
            "SpecExtend: option 'private_layouts' has no effect: it applies to compact "
            "draft positions with prefix caching only; ignored.")
    if vllm_config.use_v2_model_runner:
        logger.warning_once(
            "SpecExtend: Model Runner V2 selected; retrieval runs in its SpecExtend "
            "speculators, which are unit-tested on CPU but have not been run on a "
            "GPU yet. Unset VLLM_USE_V2_MODEL_RUNNER for the V1 runner."
        )
    return RetrievalSetup(
        config=config,
        method=method,
        draft_window=draft_window(vllm_config),
        num_speculative_tokens=spec.num_speculative_tokens,
        compact_positions=compact,
        steps_in_flight=vllm_config.max_concurrent_batches,
        private_layouts=(compact and config.private_layouts
                         and bool(vllm_config.cache_config.enable_prefix_caching)),
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        full_graph_query_len=full_decode_graph_query_len(vllm_config),
    )


_KEPT_SETUPS: dict[int, RetrievalSetup | None] = {}
"""Resolved set-ups by ``id`` of their live ``VllmConfig`` (see :func:`kept_setup`)."""


def kept_setup(vllm_config: Any) -> RetrievalSetup | None:
    """The engine's set-up: resolved at the first read of this ``VllmConfig``
    in this process (engine construction, in the process that builds the
    engine) and kept for every later reader of the same config.

    Kept beside the config, not on it: vLLM's ``config.utils.replace`` (the
    drafter's config is one) refuses attributes that are not fields, and
    ``additional_config`` is hashed as JSON. The engine core and the workers
    get the config pickled, so each of their processes resolves it once more
    (the same inputs, the same result), at its first reader."""
    key = id(vllm_config)
    if key not in _KEPT_SETUPS:
        _KEPT_SETUPS[key] = resolve_setup(vllm_config)
        weakref.finalize(vllm_config, _KEPT_SETUPS.pop, key, None)
    return _KEPT_SETUPS[key]


def full_decode_graph_query_len(vllm_config: Any) -> int | None:
    """``1 + K`` when the V1 runner replays FULL CUDA graphs for uniform
    decode batches (``cudagraph_mode`` FULL_DECODE_ONLY or FULL_AND_PIECEWISE,
    vLLM's GPU default): its dispatcher takes a batch as one only when every
    request verifies ``1 + K`` tokens; any other decode batch runs PIECEWISE
    (or eagerly). None otherwise (FULL for every batch, PIECEWISE, none)."""
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if mode is None or mode.decode_mode().name != "FULL" or not mode.separate_routine():
        return None
    return 1 + vllm_config.speculative_config.num_speculative_tokens


PRIVATE_LAYOUT_SHARE = 0.25
"""Most of the KV cache's blocks that private layouts may take."""


def private_layout_blocks(
    setup: RetrievalSetup, num_blocks: int, block_size: int, max_model_len: int
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


def _check_speculation_control(vllm_config: Any) -> None:
    """Goodput control sets each request's number of drafts after the
    drafter ran; vLLM's synchronous scheduler takes the drafts as they come."""
    if vllm_config.scheduler_config.async_scheduling:
        raise SpecExtendConfigError(
            "spec_extend's speculation_control='goodput' needs vLLM's synchronous "
            "scheduler (each request's number of drafts is decided after the "
            "drafter runs; the async scheduler reserves K draft slots per request "
            "one step ahead). Remove async_scheduling=True (--async-scheduling); "
            "with it unset, SpecExtend selects the synchronous scheduler."
        )
    if vllm_config.use_v2_model_runner:
        raise SpecExtendConfigError(
            "spec_extend's speculation_control='goodput' runs in vLLM's V1 model "
            "runner only so far, but this engine selected Model Runner V2. Unset "
            "VLLM_USE_V2_MODEL_RUNNER (or set it to 0)."
        )


def needs_synchronous_scheduler(config: SpecExtendConfig) -> bool:
    """Whether the options read each step's accepted drafts on the host
    (goodput control, acceptance-driven refresh)."""
    refreshes_on_acceptance = config.retrieves and config.retrieval_refresh == "acceptance"
    return config.controls_speculation or refreshes_on_acceptance


def _check_acceptance_refresh(vllm_config: Any) -> None:
    """Acceptance is read from each request's context length on the host;
    vLLM's async scheduler counts every draft as accepted there (its
    ``seq_lens_cpu_upper_bound``) and learns the real count a step late, so
    the refresh would never fire."""
    if vllm_config.scheduler_config.async_scheduling:
        raise SpecExtendConfigError(
            "spec_extend's retrieval_refresh='acceptance' needs vLLM's synchronous "
            "scheduler: it reads each request's accepted drafts on the host, which "
            "the async scheduler only knows a step late (it counts every draft as "
            "accepted). Remove async_scheduling=True (--async-scheduling; with it "
            "unset, SpecExtend selects the synchronous scheduler), or use "
            "retrieval_refresh='interval'."
        )


def _check_micro_batching(vllm_config: Any) -> None:
    """The tap records the target's query rows from row 0 of a fixed buffer
    per forward: a second micro-batch would overwrite the first one's."""
    parallel = vllm_config.parallel_config
    enable_dbo = bool(getattr(parallel, "enable_dbo", False))
    ubatch_size = int(getattr(parallel, "ubatch_size", 0) or 0)
    if enable_dbo or ubatch_size > 1:
        option = "enable_dbo=True" if enable_dbo else f"ubatch_size={ubatch_size}"
        raise SpecExtendConfigError(
            f"spec_extend does not support micro-batching ({option}, --enable-dbo / "
            "--ubatch-size): each micro-batch's forward would overwrite the target "
            "queries retrieval recorded for the previous one. Remove the option, or "
            "spec_extend."
        )


def _check_mrv2_data_parallel(vllm_config: Any) -> None:
    """In Model Runner V2 an EAGLE head's / MTP layer's step 0 runs eagerly
    on a rank that compacts a row while other ranks may replay its CUDA graph
    (``drafters/mrv2_target_dependent.py``); with data parallelism the ranks'
    forwards (and their collectives) would not match."""
    size = vllm_config.parallel_config.data_parallel_size
    if size > 1:
        raise SpecExtendConfigError(
            f"spec_extend with an EAGLE head or MTP layer in Model Runner V2 does not "
            f"support data_parallel_size={size}: a rank that compacts a request runs "
            "the head's first pass outside its CUDA graph while other ranks may replay "
            "theirs. Use vLLM's V1 model runner (unset VLLM_USE_V2_MODEL_RUNNER) or "
            "data_parallel_size=1."
        )


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


def _check_mtp(spec: Any, use_v2_model_runner: bool) -> None:
    """MTP layers with their own attention over the target's KV cache group run
    in vLLM's EAGLE drafters; other MTP designs have drafters of their own."""
    own_drafter = {
        "use_gemma4_mtp": "Gemma4 MTP (query-only layers that read the target's KV)",
        "use_step3p5_mtp": "Step-3.5 MTP",
    }
    if use_v2_model_runner:
        own_drafter["use_multi_module_mtp"] = (
            "multi-module MTP in Model Runner V2 (more than one MTP layer drafting)"
        )
    for check, name in own_drafter.items():
        if getattr(spec, check, lambda: False)():
            raise SpecExtendConfigError(
                f"spec_extend does not support {name}: it runs in a drafter of its "
                "own, which retrieval does not hook. Remove spec_extend, or use a "
                "single-layer MTP model"
                + (" or vLLM's V1 model runner" if use_v2_model_runner else "") + "."
            )


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


def check_layers_write_kv_through_update(layers: dict[str, Any]) -> None:
    """Refuse attention layers that write their KV in a fused op of the model
    (vLLM 0.33's ``Attention.kv_cache_update_bypass``): they skip
    ``do_kv_cache_update``, so the tap (and the plain draft KV copy) would
    miss their keys. Checked when the drafter attaches, at model load."""
    bypassing = sorted(name for name, layer in layers.items()
                       if getattr(layer, "kv_cache_update_bypass", False))
    if bypassing:
        raise SpecExtendConfigError(
            f"spec_extend does not support attention layers that write their KV cache "
            f"in a fused kernel of the model (kv_cache_update_bypass: {bypassing}): "
            "retrieval reads the keys in do_kv_cache_update, which they skip. Use a "
            "model without the fused KV insert, or remove spec_extend."
        )


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
    window = _sliding_window(model_config)
    if model_config.is_hybrid or model_config.is_attention_free:
        kind = "hybrid or attention-free layers (state-space / linear attention)"
    elif window is not None:
        kind = f"sliding-window attention (sliding_window={window})"
    else:
        return
    raise SpecExtendConfigError(
        f"spec_extend rewrites one full-attention block table shared by target and "
        f"draft, but the {role} model {model_config.model} uses {kind}, whose KV "
        "cache it cannot compact. Use full-attention models, or remove spec_extend."
    )


def _sliding_window(model_config: Any) -> int | None:
    """The model's sliding window, if any layer uses it. With ``layer_types``
    the layers decide (vLLM's Llama layers read them): speculators' heads keep
    its default ``sliding_window`` beside all-``full_attention`` layers."""
    window = model_config.get_sliding_window()
    layer_types = getattr(model_config.hf_text_config, "layer_types", None)
    if window is not None and layer_types and "sliding_attention" not in layer_types:
        return None
    return window


def _check_eagle3_aux_layers(vllm_config: Any) -> None:
    """Refuse EAGLE-3 aux hidden-state layers the target cannot provide:
    vLLM keeps each id once, so a repeated id (its default ``(2, L // 2, L - 3)``
    on a 4-layer target) starves the head's input layer at the first step."""
    hf_config = vllm_config.speculative_config.draft_model_config.hf_config
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    eagle_config = getattr(hf_config, "eagle_config", None)
    if not ids and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
    source = "the head's eagle_aux_hidden_state_layer_ids"
    if not ids:
        ids = (2, num_layers // 2, num_layers - 3)
        source = "vLLM's default (2, L // 2, L - 3)"
    ids = tuple(ids)
    if len(set(ids)) != len(ids) or not all(0 <= i <= num_layers for i in ids):
        raise SpecExtendConfigError(
            f"EAGLE-3 aux hidden-state layers {ids} ({source}) are not distinct layer "
            f"ids in 0..{num_layers} for this {num_layers}-layer target, so the head "
            "would get fewer hidden states than it was trained on. Set "
            "eagle_aux_hidden_state_layer_ids in the head's config.json."
        )
