"""What SpecExtend refuses in an engine's vLLM config, each with the reason
and the remedy: the checks :func:`~vllm_specextend.common.engine_setup.resolve_setup`
runs at engine construction, and those the drafter runs at model load
(:func:`check_layers_write_kv_through_update`) and once vLLM has settled its
CUDA graph mode (:func:`check_paused_steps_have_graphs`). Each reads vLLM's config and
raises :class:`SpecExtendConfigError`; none changes anything."""

from __future__ import annotations

from typing import Any

from vllm_specextend.common.options import SpecExtendConfigError


def check_speculation_control(vllm_config: Any) -> None:
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
    check_paused_steps_have_graphs(vllm_config)


def check_paused_steps_have_graphs(vllm_config: Any) -> None:
    """A step where goodput control pauses verifies one token per request.
    vLLM's V1 runner keeps FULL decode graphs for ``1 + K`` tokens per
    request only, so under ``FULL_DECODE_ONLY`` (FULL decode graphs, none for
    other batches) every paused step would run without CUDA graphs: on an
    H200 an 8B-shaped target's paused step took ~48 ms against ~9.5-15 ms in
    its graph (benchmarks/results/gpu-goodput-floor). Read at construction
    and again once the runner has settled the mode for its attention
    backends (it may turn FULL or FULL_AND_PIECEWISE into FULL_DECODE_ONLY)."""
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if mode is not None and mode.decode_mode().name == "FULL" and mode.mixed_mode().name == "NONE":
        raise SpecExtendConfigError(
            "spec_extend's speculation_control='goodput' cannot run with "
            f"cudagraph_mode={mode.name}: a step where it pauses verifies one token "
            "per request, and vLLM captures FULL decode graphs only for 1 + "
            "num_speculative_tokens tokens per request, so every paused step would "
            "run without CUDA graphs (3-5x slower than the target alone's step with "
            "an 8B-shaped target on an H200). Use cudagraph_mode FULL (one graph for "
            "any batch, where the attention backend supports it) or FULL_AND_PIECEWISE "
            "(vLLM's default, with torch.compile), or leave speculation_control unset."
        )


def check_acceptance_refresh(vllm_config: Any) -> None:
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


def check_micro_batching(vllm_config: Any) -> None:
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


def check_mrv2_data_parallel(vllm_config: Any) -> None:
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


def check_mrv2_adaptive_verification(vllm_config: Any) -> None:
    """Model Runner V2's adaptive verification re-allocates each request's
    drafts on the device after the scheduler's step, so the query boundaries
    the draft reads differ from the host query lengths the planner classifies
    rows and places the recent window by (``drafters/mrv2_overrides.py``)."""
    if getattr(vllm_config.speculative_config, "enable_adaptive_verification", False):
        raise SpecExtendConfigError(
            "spec_extend does not support enable_adaptive_verification=True in Model "
            "Runner V2: it moves each request's query boundaries on the device, while "
            "retrieval plans the draft's view from the host query lengths. Remove "
            "enable_adaptive_verification from speculative_config, or spec_extend."
        )


def check_mtp(spec: Any, use_v2_model_runner: bool) -> None:
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


def check_kv_cache_reaches_tap(vllm_config: Any) -> None:
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


def check_full_attention(role: str, model_config: Any) -> None:
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


def check_eagle3_aux_layers(vllm_config: Any) -> None:
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
