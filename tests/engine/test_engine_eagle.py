"""Engine tests: EAGLE heads (``eagle``, ``eagle3``, from ``tests/eagle_heads.py``)
and MTP layers (``mtp``, a tiny MiMo target) with SpecExtend in vLLM's V1 runner.

A head's first pass reuses the target's positions and attention metadata and
its attention layer shares the target's block table, so the head gets the
compacted table at every build. Greedy outputs stay the target's; keeping
everything is stock drafting; a head whose window is shorter than the inputs
drafts for every row at compact positions, where stock vLLM makes no drafter
call for the whole batch.
"""

import pytest

from tests.eagle_heads import build_eagle_head, build_trained_eagle_head
from tests.engine_utils import (
    DRAFT_READS,
    SMALL_CACHE,
    assert_draft_positions_exact,
    assert_drafted_from_compacted_views,
    corpus_prompts,
    draft_positions,
    engine,
    generate_greedy,
    run_engine,
    spec_decode_counters,
    watch_draft_positions,
)
from tests.tiny_models import (
    TARGET_LLAMA,
    TARGET_QWEN2,
    build_damped_attention_copy,
    build_model,
    build_mtp_target,
)

pytestmark = pytest.mark.engine

MAX_TOKENS = 32
BLOCK_SIZE = 32  # DEFAULT_ENGINE_KWARGS
LENGTHS = [150, 1200, 3000, 600]
WINDOW = 512
# sink 32 + 2 chunks of 32 + recent 256 (+31) + 4 x 4 queries + 3 = 402 <= 512.
WINDOW_OPTIONS = {"top_k_chunks": 2, "sink_tokens": 32, "recent_tokens": 256,
                  "min_context_tokens": 512}


# Drafted tokens, accepted tokens, compacted draft forwards of
# test_retrieval_with_a_head_equals_target_alone: floors under what the tiny
# drafters give (measured: 744 drafted, 189 compacted forwards for each head,
# 732 and 189 for MTP). The untrained heads never match the target (0
# accepted, so no acceptance floor; test_short_window_head_drafts_every_row_
# at_compact_positions asserts a trained head's); the MTP layer accepted 4.
HEAD_FLOORS = {("eagle", "cmr"): (700, 0, 170), ("eagle3", "cmr"): (700, 0, 170),
               ("eagle3", "streaming"): (700, 0, 170), ("mtp", "cmr"): (690, 3, 170)}


def drafting(method: str) -> tuple:
    """(engine target, the same target without drafting layers, head, K/V
    layers of the target) for ``method``: a head for the tiny Llama target, or
    the MTP layer of a MiMo target whose base is the tiny Qwen2."""
    if method == "mtp":
        return build_mtp_target(TARGET_QWEN2), build_model(TARGET_QWEN2), None, 3
    return build_model(TARGET_LLAMA), build_model(TARGET_LLAMA), \
        build_eagle_head(TARGET_LLAMA, method), 4


@pytest.fixture(scope="module")
def prompts(target_model):
    return corpus_prompts(target_model, LENGTHS)


@pytest.mark.parametrize("kind,mode", [("eagle", "cmr"), ("eagle3", "cmr"),
                                       ("eagle3", "streaming"), ("mtp", "cmr")])
def test_retrieval_with_a_head_equals_target_alone(kind, mode, prompts, target_reference):
    """Mutation: the V1 drafter not handing the view's block table to the
    head's metadata build fails ``stale_reads == 0``."""
    target, base, head, _ = drafting(kind)
    target_alone = target_reference(base, prompts, MAX_TOKENS)
    run = run_engine(target, prompts, MAX_TOKENS, draft=head, method=kind,
                     spec_extend={**SMALL_CACHE, "mode": mode}, enable_prefix_caching=True,
                     repeat=2, worker_hooks=DRAFT_READS)
    assert run.token_ids == target_alone * 2
    assert run.retrieval["retrievals"] > 0
    assert run.retrieval["kept_fraction"] < 0.3
    assert_drafted_from_compacted_views(run, *HEAD_FLOORS[kind, mode])


def test_keeping_everything_is_stock_eagle3(target_model, prompts):
    head = build_eagle_head(TARGET_LLAMA, "eagle3")
    stock = run_engine(target_model, prompts, MAX_TOKENS, draft=head, method="eagle3")
    everything = run_engine(target_model, prompts, MAX_TOKENS, draft=head, method="eagle3",
                            spec_extend={"top_k_chunks": 100_000, "min_context_tokens": 0})
    assert stock.retrieval is None
    assert everything.token_ids == stock.token_ids
    assert everything.spec_decode == stock.spec_decode
    assert everything.retrieval["retrievals"] > 0
    assert everything.retrieval["kept_fraction"] == 1.0


def _record_head_calls(worker) -> None:
    """Count the drafter's ``propose`` calls and the highest position the head runs at."""
    drafter = worker.model_runner.drafter
    drafter._test_log = {"propose_calls": 0, "max_position": -1}
    propose = drafter.propose

    def counting_propose(*args, **kwargs):
        drafter._test_log["propose_calls"] += 1
        return propose(*args, **kwargs)

    def record_positions(module, args, kwargs):
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if positions is not None and positions.numel():
            log = drafter._test_log
            log["max_position"] = max(log["max_position"], int(positions.max()))

    drafter.propose = counting_propose
    drafter.model.register_forward_pre_hook(record_positions, with_kwargs=True)


def _head_calls(worker) -> dict:
    return dict(worker.model_runner.drafter._test_log)


@pytest.fixture(scope="module")
def damped_target():
    return build_damped_attention_copy(TARGET_LLAMA, 0.05)


@pytest.fixture(scope="module")
def short_window_head(damped_target):
    return build_trained_eagle_head(damped_target, kind="eagle3", window=WINDOW)


@pytest.mark.parametrize("spec_extend", [None, WINDOW_OPTIONS], ids=["stock", "cmr"])
def test_short_window_head_drafts_every_row_at_compact_positions(
    spec_extend, damped_target, short_window_head, target_reference
):
    prompts = corpus_prompts(damped_target, [1500, 3000, 2200, 1800])
    reference = target_reference(damped_target, prompts, MAX_TOKENS)
    with engine(damped_target, short_window_head, method="eagle3",
                spec_extend=spec_extend) as llm:
        llm.collective_rpc(_record_head_calls)
        if spec_extend is not None:
            llm.collective_rpc(watch_draft_positions)
        outputs = generate_greedy(llm, prompts, MAX_TOKENS)
        calls = llm.collective_rpc(_head_calls)[0]
        positions = llm.collective_rpc(draft_positions)[0] if spec_extend else None
        counters = spec_decode_counters(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    if spec_extend is None:
        # vLLM's batch-wide gate: past the head's window nobody drafts (its
        # counters still count K phantom drafts per step).
        assert calls["propose_calls"] == 0
        return
    assert calls["propose_calls"] >= MAX_TOKENS // 4
    assert 0 <= calls["max_position"] < WINDOW
    # Every head forward, the first pass and each later draft step, at its
    # original position minus its row's removed tokens. Mutations that fail
    # it: later draft steps unshifted or left at the first pass's per-token
    # shifts; compacted rows one position off. Measured: 135 compacted
    # forwards, 90 of them later draft steps.
    assert_draft_positions_exact(positions, min_later_steps=75)
    acceptance = counters["num_accepted_tokens"] / counters["num_draft_tokens"]
    assert acceptance > 0.2


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_preemption_and_aborts_with_a_head(method, target_reference):
    from tests.engine.test_engine_faults import settle_and_count, tokens
    from tests.engine_utils import greedy, retrieval_metrics

    target, base, head, num_layers = drafting(method)
    prompts = corpus_prompts(target, [600, 650, 700, 750])
    reference = target_reference(base, prompts, 200)
    # Per token: the target's layers and the head's 1 x (K, V) x 2 heads x
    # 32 dims x fp32 = 512 bytes each, plus the tap's 256: 96 blocks of 32
    # tokens hold the four prompts but not their 800 generated tokens on top.
    kv_bytes = 96 * 32 * ((num_layers + 1) * 512 + 256)
    with engine(target, head, method=method, spec_extend=SMALL_CACHE,
                kv_cache_memory_bytes=kv_bytes, max_model_len=3000) as llm:
        assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == 96
        outputs = llm.generate([tokens(p) for p in prompts], greedy(200), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        assert [m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"][0] > 0
        # Abort one of two long requests mid-decode; the other is unchanged.
        engine_core = llm.llm_engine
        for i, prompt in enumerate(prompts[2:]):
            engine_core.add_request(f"abort-{i}", tokens(prompt), greedy(200))
        for _ in range(100):
            engine_core.step()
            if retrieval_metrics(llm)["tracked_requests"] == 2:
                break
        engine_core.abort_request(["abort-0"])
        finished = {}
        while engine_core.has_unfinished_requests():
            for output in engine_core.step():
                if output.finished:
                    finished[output.request_id] = list(output.outputs[0].token_ids)
        assert finished == {"abort-1": reference[3]}
        assert settle_and_count(llm) == 0


def _install_poisoning(worker) -> None:
    """Record the head's drafts; before each proposal, optionally overwrite
    the head's KV in the blocks retrieval evicted (or kept) for each row with
    large noise, and restore it after the proposal."""
    import torch

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    drafter = worker.model_runner.drafter
    drafter._test = {"mode": "none", "drafts": [], "poisoned_blocks": 0, "builds": []}
    build, propose = drafter.build_per_group_and_layer_attn_metadata, drafter.propose
    stock_build = SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata

    def capturing_build(self, cad, draft_index=0):
        """What vLLM's metadata build receives for the head's first pass."""
        if self is drafter and draft_index == 0 and drafter._draft_view is not None:
            n = cad.num_reqs
            drafter._test["builds"][-1]["head"] = (cad.seq_lens[:n].tolist(),
                                                   cad.block_table_tensor[:n].tolist())
        return stock_build(self, cad, draft_index)

    SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata = capturing_build
    drafter._test_restore = lambda: setattr(
        SpecDecodeBaseProposer, "build_per_group_and_layer_attn_metadata", stock_build)
    layers = list(drafter.retrieval.draft_layers.values())
    saved = []

    def poison(cad):
        view, mode = drafter._draft_view, drafter._test["mode"]
        if view is None or mode == "none":
            return
        block_size = drafter.retrieval.block_size
        seq_lens, removed = cad.seq_lens.tolist(), view.removed_tokens.tolist()
        for row in range(cad.num_reqs):
            if removed[row] == 0:
                continue
            used = -(-seq_lens[row] // block_size)
            original = set(cad.block_table_tensor[row, :used].tolist())
            kept = view.block_table[row, : used - removed[row] // block_size].tolist()
            # Kept: the chunks before the recent window (never the query's blocks).
            blocks = original - set(kept) if mode == "evicted" else set(kept[1:-3])
            for layer in layers:
                for block in blocks:
                    saved.append((layer.kv_cache, block, layer.kv_cache[block].clone()))
                    layer.kv_cache[block] = torch.randn_like(layer.kv_cache[block]) * 100
            drafter._test["poisoned_blocks"] += len(blocks)

    def poisoning_build(cad, draft_index=0):
        if draft_index == 0:
            n = cad.num_reqs
            drafter._test["builds"].append({"target": (cad.seq_lens[:n].tolist(),
                                                       cad.block_table_tensor[:n].tolist())})
            poison(cad)
        return build(cad, draft_index)

    def recording_propose(*args, **kwargs):
        try:
            drafts = propose(*args, **kwargs)
        finally:
            while saved:
                cache, block, original = saved.pop()
                cache[block] = original
        drafter._test["drafts"].append(drafts.tolist())
        return drafts

    drafter.build_per_group_and_layer_attn_metadata = poisoning_build
    drafter.propose = recording_propose


def _poison(worker, mode: str) -> None:
    worker.model_runner.drafter._test.update(mode=mode, drafts=[], poisoned_blocks=0, builds=[])


def _remove_capture(worker) -> None:
    worker.model_runner.drafter._test_restore()


def _poisoning_record(worker) -> dict:
    return dict(worker.model_runner.drafter._test)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_the_head_reads_only_the_blocks_retrieval_keeps(method, target_reference):
    target, base, head, _ = drafting(method)
    prompts = corpus_prompts(target, [1200, 3000])
    reference = target_reference(base, prompts, MAX_TOKENS)
    records = {}
    with engine(target, head, method=method, spec_extend=SMALL_CACHE,
                enable_prefix_caching=False) as llm:
        llm.collective_rpc(_install_poisoning)
        for mode in ("none", "evicted", "kept"):
            llm.collective_rpc(_poison, args=(mode,))
            outputs = generate_greedy(llm, prompts, MAX_TOKENS)
            assert [list(o.outputs[0].token_ids) for o in outputs] == reference
            records[mode] = llm.collective_rpc(_poisoning_record)[0]
        llm.collective_rpc(_remove_capture)
    clean, evicted, kept = records["none"], records["evicted"], records["kept"]
    # The head's metadata (captured as vLLM's builder receives it): on rows
    # retrieval compacted, fewer tokens and a subsequence of the blocks, in
    # order, ending with the query's block.
    compacted = 0
    for build in clean["builds"]:
        if "head" not in build:
            continue
        for (full_len, full_row), (head_len, head_row) in zip(zip(*build["target"]),
                                                               zip(*build["head"])):
            full_blocks = full_row[: -(-full_len // BLOCK_SIZE)]
            head_blocks = head_row[: -(-head_len // BLOCK_SIZE)]
            assert head_len <= full_len and head_blocks[-1] == full_blocks[-1]
            position = iter(full_blocks)
            assert all(block in position for block in head_blocks)  # in order
            compacted += head_len < full_len
    assert compacted > 0
    assert evicted["poisoned_blocks"] > 0 and kept["poisoned_blocks"] > 0
    # Noise in evicted blocks never reaches a draft; noise in kept ones does.
    assert evicted["drafts"] == clean["drafts"]
    assert kept["drafts"] != clean["drafts"]
