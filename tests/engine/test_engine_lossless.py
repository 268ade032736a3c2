"""Engine tests: retrieval never changes what the target generates.

Tiny float32 models (see tiny_models.py) keep greedy decoding far from ties,
so every comparison is exact. One engine per configuration; the target
alone is the run-wide reference (``target_reference``), stock drafting a
session fixture.
"""

import pytest

from benchmarks.worker_hooks import reconfigure_drafter
from tests.engine_utils import (
    DRAFT_READS,
    SMALL_CACHE,
    assert_drafted_from_compacted_views,
    corpus_prompts,
    counter_deltas,
    engine,
    generate_greedy,
    run_engine,
    spec_decode_counters,
)
from tests.tiny_models import TARGET_QWEN2, build_model, build_noisy_copy
from vllm_specextend.metrics import worker_metrics

pytestmark = pytest.mark.engine

MAX_TOKENS = 48
# Prompts from shorter than SMALL_CACHE's gate to ~35x its working cache.
LENGTHS = [150, 1200, 3000, 7000]


@pytest.fixture(scope="session")
def prompts(target_model):
    base = corpus_prompts(target_model, LENGTHS)
    other = corpus_prompts(target_model, [600], offset=50_000)[0]
    # Shares 2,048 tokens with prompt 2, for prefix caching.
    return base + [base[2][:2048] + other]


@pytest.fixture(scope="session")
def target_alone(target_reference, target_model, prompts):
    return target_reference(target_model, prompts, MAX_TOKENS)


@pytest.fixture(scope="session")
def stock_draft(target_model, draft_model, prompts):
    return run_engine(target_model, prompts, MAX_TOKENS, draft=draft_model)


def test_stock_draft_model_with_plugin_installed_equals_target_alone(target_alone, stock_draft):
    assert stock_draft.token_ids == target_alone
    assert stock_draft.retrieval is None  # the stock proposer ran
    accepted = stock_draft.spec_decode["num_accepted_tokens"]
    assert 0 < accepted < stock_draft.spec_decode["num_draft_tokens"]


def test_cmr_with_chunked_prefill_and_prefix_caching_equals_target_alone(
    target_model, draft_model, prompts, target_alone
):
    run = run_engine(
        target_model, prompts, MAX_TOKENS, draft=draft_model,
        spec_extend={**SMALL_CACHE, "score_aggregation": "accepted_tokens"},
        max_num_batched_tokens=1024, enable_prefix_caching=True, repeat=2,
        multiprocessing=True,  # vLLM's default engine core, in a process of its own
        worker_hooks=DRAFT_READS,
    )
    assert run.token_ids == target_alone * 2
    assert run.retrieval["retrievals"] > 0
    assert run.retrieval["kept_fraction"] < 0.25
    # Measured: 1,146 drafted, 92 accepted, 309 compacted draft forwards.
    assert_drafted_from_compacted_views(run, 1000, 80, 270)


def test_streaming_equals_target_alone(target_model, draft_model, prompts, target_alone):
    run = run_engine(target_model, prompts, MAX_TOKENS, draft=draft_model,
                     spec_extend={**SMALL_CACHE, "mode": "streaming"}, worker_hooks=DRAFT_READS)
    assert run.token_ids == target_alone
    assert run.retrieval["kept_fraction"] < 0.25
    # Measured: 576 drafted, 45 accepted, 147 compacted draft forwards.
    assert_drafted_from_compacted_views(run, 500, 38, 125)


def test_cmr_under_torch_compile_equals_target_alone(
    target_model, draft_model, prompts, target_alone
):
    """Every draft forward read the compacted view. Mutations: the V1 drafter
    not swapping in the view's block table (528 stale reads), or swapping in
    the previous step's (39 stale reads), fail it."""
    run = run_engine(target_model, prompts, MAX_TOKENS, draft=draft_model,
                     spec_extend=SMALL_CACHE, enforce_eager=False, worker_hooks=DRAFT_READS)
    assert run.token_ids == target_alone
    assert run.retrieval["retrievals"] > 0
    # Measured: 567 drafted, 48 accepted, 144 compacted draft forwards.
    assert_drafted_from_compacted_views(run, 500, 40, 125)


def test_retrieval_keeping_everything_is_identical_to_stock(
    target_model, draft_model, prompts, stock_draft
):
    run = run_engine(target_model, prompts, MAX_TOKENS, draft=draft_model,
                     spec_extend={"top_k_chunks": 100_000, "min_context_tokens": 0})
    assert run.token_ids == stock_draft.token_ids
    assert run.spec_decode == stock_draft.spec_decode
    assert run.retrieval["retrievals"] > 0
    assert run.retrieval["kept_fraction"] == 1.0
    # Every drafting step went through retrieval, so its figures match vLLM's.
    counters = run.spec_decode
    assert run.retrieval["mean_acceptance_length"] == pytest.approx(
        1 + counters["num_accepted_tokens"] / counters["num_drafts"])
    # Requests leave the drafter's state at the step after they finish.
    assert run.retrieval["finished_requests"] + run.retrieval["tracked_requests"] == len(prompts)
    assert run.retrieval["request_kept_fraction"].count == run.retrieval["finished_requests"]


def test_draft_equal_to_target_accepts_less_when_it_sees_less(
    target_model, prompts, target_alone
):
    long_prompts = prompts[1:4]
    # One engine: the whole cache first (mode off drafts as stock vLLM), then
    # SMALL_CACHE; each run's counters are its own.
    # Then with retrieval refreshed on acceptance drops (at most every 16 steps).
    runs, refreshes = {}, {}
    configs = (("full", {**SMALL_CACHE, "mode": "off"}), ("small", SMALL_CACHE),
               ("on_drops", {**SMALL_CACHE, "retrieval_refresh": "acceptance",
                             "retrieval_interval": 16}))
    with engine(target_model, target_model, spec_extend=SMALL_CACHE) as llm:
        for name, options in configs:
            llm.collective_rpc(reconfigure_drafter, args=(options,))
            before = spec_decode_counters(llm), refresh_counts(llm)
            outputs = generate_greedy(llm, long_prompts, MAX_TOKENS)
            runs[name] = ([list(o.outputs[0].token_ids) for o in outputs],
                          counter_deltas(spec_decode_counters(llm), before[0]))
            refreshes[name] = counter_deltas(refresh_counts(llm), before[1])
    (full_ids, full), (small_ids, small) = runs["full"], runs["small"]
    assert full["num_accepted_tokens"] == full["num_draft_tokens"] > 0
    assert small["num_accepted_tokens"] < 0.8 * small["num_draft_tokens"]
    assert full_ids == small_ids == runs["on_drops"][0] == target_alone[1:4]
    assert refreshes["small"]["acceptance"] == 0 < refreshes["small"]["interval"]
    assert refreshes["on_drops"]["first"] == len(long_prompts)
    assert refreshes["on_drops"]["acceptance"] > 0


def refresh_counts(llm) -> dict[str, int]:
    return llm.collective_rpc(worker_metrics)[0]["refreshes"]


def test_qwen2_cmr_equals_target_alone(target_reference):
    target = build_model(TARGET_QWEN2)
    draft = build_noisy_copy(TARGET_QWEN2, noise=0.03)
    prompts = corpus_prompts(target, [200, 2500, 5000])
    alone = target_reference(target, prompts, MAX_TOKENS)
    cmr = run_engine(target, prompts, MAX_TOKENS, draft=draft, spec_extend=SMALL_CACHE,
                     worker_hooks=DRAFT_READS)
    assert cmr.token_ids == alone
    assert cmr.retrieval["retrievals"] > 0
    # Measured: 324 drafted, 33 accepted, 138 compacted draft forwards.
    assert_drafted_from_compacted_views(cmr, 290, 28, 120)
