"""spec_extend options: defaults, and one clear error per bad input at engine
construction (``EngineArgs.create_engine_config``), before any model loads."""

import pytest

from vllm_specextend.common.options import SpecExtendConfig, SpecExtendConfigError


def engine_config(target, draft=None, spec_extend=None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(target), block_size=32, max_model_len=2048,
                enforce_eager=True, dtype="float32")
    if draft is not None:
        args["speculative_config"] = {"method": "draft_model", "model": str(draft),
                                      "num_speculative_tokens": 3}
    if spec_extend is not None:
        args["additional_config"] = {"spec_extend": spec_extend}
    return EngineArgs(**{**args, **kwargs}).create_engine_config()


def test_defaults_are_valid_and_chunk_size_follows_block_size():
    config = SpecExtendConfig()
    assert config.mode == "cmr" and config.enabled
    assert config.resolved_chunk_size(16) == 32
    assert config.resolved_chunk_size(128) == 128
    assert SpecExtendConfig(chunk_size=256).resolved_chunk_size(128) == 256


def test_default_top_k_retrieves_a_fixed_token_budget():
    config = SpecExtendConfig()
    assert config.resolved_top_k_chunks(128) == 4  # vLLM's CPU block size
    assert config.resolved_top_k_chunks(32) == 16  # 16-token GPU blocks
    assert config.resolved_top_k_chunks(1024) == 1  # never zero by default
    assert SpecExtendConfig(top_k_chunks=0).resolved_top_k_chunks(32) == 0
    assert SpecExtendConfig(top_k_chunks=7).resolved_top_k_chunks(128) == 7


@pytest.mark.parametrize(
    "options,message",
    [
        ({"topk": 4}, r"unknown spec_extend option\(s\) \['topk'\]; allowed options: \['mode'"),
        ({"mode": "fast"}, r"'mode'='fast' is invalid; allowed values: \['cmr', 'streaming', 'off'\]"),
        ({"top_k_chunks": "8"}, r"'top_k_chunks' must be an integer, got str"),
        ({"top_k_chunks": True}, r"'top_k_chunks' must be an integer, got bool"),
        ({"retrieval_interval": 0}, r"'retrieval_interval'=0 is out of range; allowed: an integer >= 1"),
        ({"sink_tokens": -1}, r"'sink_tokens'=-1 is out of range"),
        ({"chunk_size": 0}, r"'chunk_size'=0 is out of range"),
        ({"score_aggregation": "max"}, r"'score_aggregation'='max' is invalid; allowed values: \['last_token', 'accepted_tokens'\]"),
        ({"draft_positions": "shifted"}, r"'draft_positions'='shifted' is invalid; allowed values: \['auto', 'original', 'compact'\]"),
        ([1, 2], r"must be a JSON object of options, got list"),
    ],
)
def test_bad_options_fail_at_engine_construction(target_model, draft_model, options, message):
    with pytest.raises(SpecExtendConfigError, match=message):
        engine_config(target_model, draft_model, spec_extend=options)


def test_chunk_size_not_whole_blocks_fails(target_model, draft_model):
    with pytest.raises(SpecExtendConfigError, match=r"'chunk_size'=48 is not a whole number of KV blocks \(block_size=32\)"):
        engine_config(target_model, draft_model, spec_extend={"chunk_size": 48})


def test_spec_extend_without_draft_model_fails(target_model):
    with pytest.raises(SpecExtendConfigError, match=r"needs speculative decoding whose drafter "
                       r"attends to the KV cache.*got method=None"):
        engine_config(target_model, spec_extend={})


def test_spec_extend_with_ngram_fails(target_model):
    with pytest.raises(SpecExtendConfigError, match=r"got method='ngram'"):
        engine_config(
            target_model, spec_extend={},
            speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 3},
        )


@pytest.mark.parametrize(
    "engine_kwargs,message",
    [
        ({"kv_cache_dtype": "fp8"},
         r"kv_cache_dtype='fp8': retrieval scores with the target's queries and keys.*"
         r"Use kv_cache_dtype='auto'"),
        ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
         r"KV connectors or KV offloading .* load KV blocks without the attention "
         r"layers' do_kv_cache_update"),
        ({"kv_offloading_size": 1.0},
         r"KV connectors or KV offloading"),
    ],
)
def test_kv_caches_retrieval_cannot_read_are_refused(target_model, draft_model,
                                                      engine_kwargs, message):
    with pytest.raises(SpecExtendConfigError, match=message):
        engine_config(target_model, draft_model, spec_extend={}, **engine_kwargs)


def test_context_parallelism_is_refused(target_model, draft_model):
    from vllm_specextend.common.engine_setup import resolve_setup

    # Building a DCP engine config needs several devices; refuse on the config.
    config = engine_config(target_model, draft_model, spec_extend={})
    config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(SpecExtendConfigError,
                       match=r"decode_context_parallel_size=2: context parallelism interleaves"):
        resolve_setup(config)


def test_valid_options_and_mode_off_pass(target_model, draft_model):
    config = engine_config(target_model, draft_model, spec_extend={"top_k_chunks": 4, "chunk_size": 64})
    assert config.additional_config["spec_extend"]["top_k_chunks"] == 4
    # mode "off" is stock drafting and needs no draft model.
    engine_config(target_model, spec_extend={"mode": "off"})


def sliding_window_copy(model, tmp_path, window=256):
    """``model`` as a Mistral with sliding-window attention (config only)."""
    import json

    out = tmp_path / "sliding"
    out.mkdir()
    for path in model.iterdir():
        (out / path.name).symlink_to(path)
    (out / "config.json").unlink()
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"],
                  sliding_window=window)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_sliding_window_target_is_refused_with_reason(target_model, draft_model, tmp_path):
    sliding = sliding_window_copy(target_model, tmp_path)
    with pytest.raises(SpecExtendConfigError,
                       match=r"the target model .* uses sliding-window attention \(sliding_window=256\)"):
        engine_config(sliding, draft_model, spec_extend={})
    # Without spec_extend the same engine is stock and accepted.
    engine_config(sliding, draft_model)


def test_sliding_window_draft_is_refused_with_reason(target_model, draft_model, tmp_path):
    sliding = sliding_window_copy(draft_model, tmp_path)
    with pytest.raises(SpecExtendConfigError, match=r"the draft model .* uses sliding-window"):
        engine_config(target_model, sliding, spec_extend={})


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_layer_types_decide_whether_a_window_is_used(target_model, draft_model, tmp_path,
                                                     layer_type):
    # speculators' heads keep its default sliding_window (2048) beside layers
    # that are all full attention: vLLM's Llama layers read layer_types.
    import json

    sliding = sliding_window_copy(draft_model, tmp_path, window=2048)
    config = json.loads((sliding / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"],
                  layer_types=[layer_type] * config["num_hidden_layers"])
    (sliding / "config.json").write_text(json.dumps(config))
    if layer_type == "full_attention":
        engine_config(target_model, sliding, spec_extend={})
    else:
        with pytest.raises(SpecExtendConfigError, match=r"sliding_window=2048"):
            engine_config(target_model, sliding, spec_extend={})


def capped_draft(max_model_len):
    """speculative_config kwargs capping the draft's window (the user's way)."""
    return lambda draft: {"method": "draft_model", "model": str(draft),
                          "num_speculative_tokens": 3, "max_model_len": max_model_len}


def test_auto_draft_positions_resolve_by_the_draft_window(target_model, draft_model):
    from vllm_specextend.common.engine_setup import uses_compact_positions

    uncapped = engine_config(target_model, draft_model, spec_extend={})
    capped = engine_config(target_model, spec_extend={},
                           speculative_config=capped_draft(1024)(draft_model))
    assert not uses_compact_positions(uncapped, SpecExtendConfig())
    assert uses_compact_positions(capped, SpecExtendConfig())


def test_window_too_small_for_the_working_cache_fails_naming_the_numbers(target_model, draft_model):
    # sink 32 + 16 chunks of 32 + recent 256 (+31) + 4 x (3 + 1) + 3 = 850 > 512.
    with pytest.raises(
        SpecExtendConfigError,
        match=r"working cache needs up to 850 draft positions, more than the draft's window "
              r"of 512: sink_tokens=32 \+ top_k_chunks=16 x chunk_size=32 \+ recent_tokens=256 "
              r".*Lower top_k_chunks, recent_tokens",
    ):
        engine_config(target_model, spec_extend={}, speculative_config=capped_draft(512)(draft_model))
    # The same window is fine with a smaller working cache.
    engine_config(target_model, spec_extend={"top_k_chunks": 2, "recent_tokens": 128},
                  speculative_config=capped_draft(512)(draft_model))


def test_original_positions_with_a_short_window_fail(target_model, draft_model):
    with pytest.raises(SpecExtendConfigError,
                       match=r"'draft_positions'='original' cannot draft requests longer than "
                             r"the draft's window \(1024 positions; the target's max_model_len is 2048\)"):
        engine_config(target_model, spec_extend={"draft_positions": "original"},
                      speculative_config=capped_draft(1024)(draft_model))


def test_compact_positions_cap_prompt_chunks_or_refuse_a_larger_user_budget(target_model, draft_model):
    config = engine_config(target_model, spec_extend={},
                           speculative_config=capped_draft(1024)(draft_model))
    assert config.scheduler_config.max_num_batched_tokens == 512  # half the window
    with pytest.raises(SpecExtendConfigError,
                       match=r"max_num_batched_tokens=2048 lets vLLM schedule prompt chunks longer "
                             r"than the draft can prefill inside its window of 1024 positions "
                             r"\(at most 957 tokens"):
        engine_config(target_model, spec_extend={}, max_num_batched_tokens=2048,
                      speculative_config=capped_draft(1024)(draft_model))
    # Stock engines keep vLLM's budget.
    stock = engine_config(target_model, speculative_config=capped_draft(1024)(draft_model))
    assert stock.scheduler_config.max_num_batched_tokens > 512


def eagle_config(target_model, kind, tmp_path=None, drop_aux_layers=False, **kwargs):
    from tests.eagle_heads import build_eagle_head
    from tests.tiny_models import TARGET_LLAMA

    head = build_eagle_head(TARGET_LLAMA, kind)
    if drop_aux_layers:
        # The head without its aux layer ids: vLLM falls back to its default.
        import json
        import shutil

        copy = tmp_path / "head"
        shutil.copytree(head, copy)
        config = json.loads((copy / "config.json").read_text())
        config.pop("eagle_aux_hidden_state_layer_ids", None)
        config.pop("eagle_config", None)
        (copy / "config.json").write_text(json.dumps(config))
        head = copy
    return engine_config(target_model, spec_extend={}, speculative_config={
        "method": kind, "model": str(head), "num_speculative_tokens": 3}, **kwargs)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_heads_are_accepted(target_model, kind):
    from vllm_specextend.common.engine_setup import resolve_setup

    setup = resolve_setup(eagle_config(target_model, kind))
    assert setup.method == kind and not setup.compact_positions


def test_eagle3_aux_layers_that_repeat_are_refused(target_model, tmp_path):
    # vLLM's default (2, L // 2, L - 3) on a 4-layer target is (2, 2, 1).
    with pytest.raises(SpecExtendConfigError, match=r"aux hidden-state layers \(2, 2, 1\) "
                       r"\(vLLM's default.*not distinct.*eagle_aux_hidden_state_layer_ids"):
        eagle_config(target_model, "eagle3", tmp_path, drop_aux_layers=True)


def test_mtp_designs_with_drafters_of_their_own_are_refused_in_model_runner_v2(monkeypatch):
    from tests.drafters.test_mrv2_draft_model import simulate_gpu
    from tests.tiny_models import TARGET_QWEN2, build_mtp_target
    from vllm_specextend.common.engine_setup import resolve_setup

    two_layers = build_mtp_target(TARGET_QWEN2, num_mtp_layers=2)
    config = engine_config(two_layers, spec_extend={}, speculative_config={
        "method": "mtp", "num_speculative_tokens": 2})
    assert resolve_setup(config).method == "mtp"  # V1: one EagleProposer
    simulate_gpu(monkeypatch, v2_env=True)
    with pytest.raises(SpecExtendConfigError,
                       match=r"does not support multi-module MTP in Model Runner V2.*"
                             r"or vLLM's V1 model runner"):
        resolve_setup(config)

def test_goodput_control_selects_the_synchronous_scheduler(target_model, draft_model):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specextend.common.engine_setup import resolve_setup

    def args(spec_extend):
        return EngineArgs(model=str(target_model), block_size=32, max_model_len=2048,
                          enforce_eager=True, dtype="float32",
                          speculative_config={"method": "draft_model", "model": str(draft_model),
                                              "num_speculative_tokens": 3},
                          additional_config={"spec_extend": spec_extend})

    stock, goodput = args({}), args({"speculation_control": "goodput"})
    stock.create_engine_config()
    config = goodput.create_engine_config()
    assert stock.async_scheduling is None  # vLLM decides, as without us
    assert goodput.async_scheduling is False  # vLLM's synchronous scheduler
    assert not config.scheduler_config.async_scheduling
    assert resolve_setup(config).config.controls_speculation
    # Control without retrieval: the whole cache, per-request draft lengths.
    alone = engine_config(target_model, draft_model,
                          spec_extend={"mode": "off", "speculation_control": "goodput"})
    assert resolve_setup(alone) is not None and not resolve_setup(alone).config.retrieves
    assert resolve_setup(engine_config(target_model, draft_model,
                                       spec_extend={"mode": "off"})) is None


def test_goodput_control_refuses_what_it_cannot_serve(target_model, draft_model, monkeypatch):
    from tests.drafters.test_mrv2_draft_model import simulate_gpu

    goodput = {"speculation_control": "goodput"}
    with pytest.raises(SpecExtendConfigError, match=r"'speculation_control'='fast' is invalid; "
                                                    r"allowed values: \['off', 'goodput'\]"):
        engine_config(target_model, draft_model, spec_extend={"speculation_control": "fast"})
    with pytest.raises(SpecExtendConfigError, match=r"'goodput_warm_up'='later' is invalid; "
                                                    r"allowed values: \['priced', 'immediate'\]"):
        engine_config(target_model, draft_model,
                      spec_extend={**goodput, "goodput_warm_up": "later"})
    from vllm_specextend.common.engine_setup import resolve_setup

    # A user's async_scheduling=True (the CPU platform turns it off itself).
    config = engine_config(target_model, draft_model, spec_extend=goodput)
    config.scheduler_config.async_scheduling = True
    with pytest.raises(SpecExtendConfigError, match=r"needs vLLM's synchronous scheduler.*"
                                                    r"Remove async_scheduling=True"):
        resolve_setup(config)
    with pytest.raises(SpecExtendConfigError, match=r"mode='off' cannot draft requests longer "
                                                    r"than the draft's window \(1024 positions"):
        engine_config(target_model, spec_extend={"mode": "off", **goodput},
                      speculative_config=capped_draft(1024)(draft_model))
    simulate_gpu(monkeypatch, v2_env=True)
    with pytest.raises(SpecExtendConfigError, match=r"speculation_control='goodput' runs in "
                                                    r"vLLM's V1 model runner only so far"):
        engine_config(target_model, draft_model, spec_extend=goodput)


def test_goodput_control_refuses_graphs_its_paused_steps_lack(target_model, draft_model):
    """Checked at construction and again once the runner settled the mode
    (``check_paused_steps_have_graphs``): the CPU platform runs no graphs, so
    the modes a GPU engine may end with are set by hand."""
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    from vllm_specextend.common.engine_checks import check_paused_steps_have_graphs
    from vllm_specextend.common.engine_setup import resolve_setup

    refused = []
    for mode in CUDAGraphMode:
        config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))
        try:
            check_paused_steps_have_graphs(config)
        except SpecExtendConfigError:
            refused.append(mode)
    assert refused == [CUDAGraphMode.FULL_DECODE_ONLY]
    goodput = {"speculation_control": "goodput"}
    config = engine_config(target_model, draft_model, spec_extend=goodput)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    with pytest.raises(SpecExtendConfigError, match=r"cannot run with cudagraph_mode="
                                                    r"FULL_DECODE_ONLY: a step where it pauses"):
        resolve_setup(config)
    stock = engine_config(target_model, draft_model, spec_extend={})
    stock.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    assert resolve_setup(stock) is not None  # retrieval alone drafts K every step


def test_acceptance_refresh_needs_the_synchronous_scheduler(target_model, draft_model):
    """Both schedulers on CPU, at the engine-options level (the CPU platform
    turns async scheduling off itself, so the async case is set by hand)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specextend.common.engine_setup import resolve_setup

    acceptance = {"retrieval_refresh": "acceptance"}
    args = EngineArgs(model=str(target_model), block_size=32, max_model_len=2048,
                      enforce_eager=True, dtype="float32",
                      speculative_config={"method": "draft_model", "model": str(draft_model),
                                          "num_speculative_tokens": 3},
                      additional_config={"spec_extend": acceptance})
    config = args.create_engine_config()
    assert args.async_scheduling is False  # chosen for it, as for goodput control
    assert resolve_setup(config).config.retrieval_refresh == "acceptance"
    config.scheduler_config.async_scheduling = True
    with pytest.raises(SpecExtendConfigError, match=r"retrieval_refresh='acceptance' needs "
                                                    r"vLLM's synchronous scheduler.*Remove "
                                                    r"async_scheduling=True.*'interval'"):
        resolve_setup(config)
    # Interval refresh reads no acceptance: the async scheduler is fine.
    interval = engine_config(target_model, draft_model, spec_extend={})
    interval.scheduler_config.async_scheduling = True
    assert resolve_setup(interval) is not None


def test_micro_batching_is_refused(target_model, draft_model):
    from vllm_specextend.common.engine_setup import resolve_setup

    for option, value in (("enable_dbo", True), ("ubatch_size", 2)):
        config = engine_config(target_model, draft_model, spec_extend={})
        setattr(config.parallel_config, option, value)
        with pytest.raises(SpecExtendConfigError, match=r"does not support micro-batching "
                                                        rf"\({option}=.*--enable-dbo"):
            resolve_setup(config)
        # Stock vLLM (no spec_extend) is left alone.
        stock = engine_config(target_model, draft_model)
        setattr(stock.parallel_config, option, value)
        assert resolve_setup(stock) is None


def test_data_parallel_heads_in_model_runner_v2_are_refused(target_model, draft_model,
                                                            monkeypatch):
    from tests.drafters.test_mrv2_draft_model import simulate_gpu
    from vllm_specextend.common.engine_setup import resolve_setup

    simulate_gpu(monkeypatch, v2_env=True)
    head = eagle_config(target_model, "eagle3")
    model = engine_config(target_model, draft_model, spec_extend={})
    for config in (head, model):
        assert config.use_v2_model_runner
        config.parallel_config.data_parallel_size = 2
    with pytest.raises(SpecExtendConfigError, match=r"Model Runner V2 does not support "
                                                    r"data_parallel_size=2.*V1 model runner"):
        resolve_setup(head)
    assert resolve_setup(model) is not None  # a draft model's step 0 always runs eagerly
    monkeypatch.setattr(head.parallel_config, "data_parallel_size", 1)
    assert resolve_setup(head) is not None


def test_adaptive_verification_in_model_runner_v2_is_refused(target_model, draft_model,
                                                             monkeypatch):
    """MRV2's adaptive verification re-allocates each request's drafts on the
    device, moving its query boundaries, while the planner classifies rows
    and places the recent window by the host's query lengths. (vLLM runs it
    in MRV2 only, with FULL CUDA graphs: set on the config, as on a GPU.)"""
    from tests.drafters.test_mrv2_draft_model import simulate_gpu
    from vllm_specextend.common.engine_setup import resolve_setup

    simulate_gpu(monkeypatch, v2_env=True)
    ours = engine_config(target_model, draft_model, spec_extend={})
    stock = engine_config(target_model, draft_model)
    for config in (ours, stock):
        assert config.use_v2_model_runner
        config.speculative_config.enable_adaptive_verification = True
    with pytest.raises(SpecExtendConfigError,
                       match=r"enable_adaptive_verification=True in Model Runner V2.*"
                             r"host query lengths.*Remove enable_adaptive_verification"):
        resolve_setup(ours)
    assert resolve_setup(stock) is None  # stock vLLM is left alone


def test_options_a_setting_makes_meaningless_are_named(target_model, draft_model, monkeypatch):
    from vllm_specextend.common import engine_setup

    warned = []
    monkeypatch.setattr(engine_setup.logger, "warning_once",
                        lambda message, *args: warned.append(message % args))
    engine_config(target_model, draft_model, spec_extend={"acceptance_drop": 0.3})
    assert warned == ["SpecExtend: option 'acceptance_drop' has no effect: "
                      "retrieval_refresh='interval' retrieves every retrieval_interval steps "
                      "(set retrieval_refresh='acceptance' to use it); ignored."]
    warned.clear()
    engine_config(target_model, draft_model,
                  spec_extend={"retrieval_refresh": "acceptance", "acceptance_drop": 0.3})
    engine_config(target_model, draft_model, spec_extend={})
    assert warned == []
    engine_config(target_model, draft_model,
                  spec_extend={"mode": "streaming", "score_aggregation": "accepted_tokens"})
    engine_config(target_model, draft_model, spec_extend={"private_layouts": False})
    assert [w.split(":")[1] for w in warned] == [" option 'score_aggregation' has no effect",
                                                 " option 'private_layouts' has no effect"]
    config = SpecExtendConfig(mode="off", speculation_control="goodput", chunk_size=64)
    assert engine_setup.meaningless_options(
        {"mode": "off", "speculation_control": "goodput", "chunk_size": 64}, config) == {
        "chunk_size": "mode='off' retrieves nothing"}
    config = SpecExtendConfig(mode="off", goodput_warm_up="immediate")
    assert engine_setup.meaningless_options({"mode": "off", "goodput_warm_up": "immediate"},
                                            config) == {
        "goodput_warm_up": "speculation_control='off' has no warm-up"}


def test_goodput_control_on_a_gpu_says_it_does_not_hold_its_floor(target_model, draft_model,
                                                                  monkeypatch):
    """Measured on an H200 (benchmarks/results/gpu-goodput-floor): the
    synchronous scheduler and the V1 runner goodput control needs cost more
    than its floor allows; said at construction on CUDA, not on CPU."""
    from vllm_specextend.common import engine_setup

    warned = []
    monkeypatch.setattr(engine_setup.logger, "warning_once",
                        lambda message, *args: warned.append(message % args))
    goodput = {"speculation_control": "goodput"}
    config = engine_config(target_model, draft_model, spec_extend=goodput)
    assert warned == []
    config.device_config.device_type = "cuda"
    engine_setup.resolve_setup(config)
    assert len(warned) == 1 and "does not hold its floor on GPUs yet" in warned[0]


def test_empty_options_turn_cmr_on_with_every_default(target_model, draft_model):
    """``{"spec_extend": {}}``: SpecExtend with its defaults (mode cmr), as the
    option table says; only no ``spec_extend`` key at all leaves vLLM stock."""
    from vllm_specextend.common.engine_setup import resolve_setup

    setup = resolve_setup(engine_config(target_model, draft_model, spec_extend={}))
    assert setup.config == SpecExtendConfig() and setup.config.mode == "cmr"
    assert resolve_setup(engine_config(target_model, draft_model)) is None
