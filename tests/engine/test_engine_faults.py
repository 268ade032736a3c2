"""Faults: preemption, aborts, max_model_len, many requests. No crash, no
output change, and per-request retrieval state returns to empty (read through
the public metrics: ``vllm:spec_extend_tracked_requests``)."""

import pytest

from tests.engine_utils import SMALL_CACHE, corpus_prompts, engine, greedy, retrieval_metrics

pytestmark = pytest.mark.engine

# Original positions (uncapped draft), or compact ones: the draft's window is
# shorter than the prompts, so they are prefilled and drafted inside it.
DRAFT_POSITIONS = pytest.mark.parametrize("draft_window", [None, 512], ids=["original", "compact"])


def tracked_requests(llm) -> int:
    return retrieval_metrics(llm)["tracked_requests"]


def tokens(prompt_ids):
    from vllm import TokensPrompt

    return TokensPrompt(prompt_token_ids=prompt_ids)


def settle_and_count(llm) -> int:
    """Tracked requests after one more short request (finished requests are
    reported to the worker at the next step)."""
    llm.generate([tokens([5, 6, 7])], greedy(2), use_tqdm=False)
    return tracked_requests(llm)


@DRAFT_POSITIONS
def test_preemption_keeps_outputs_and_frees_state(target_model, draft_model, draft_window,
                                                  target_reference):
    """Mutation: ``RetrievalPlanner._requests_left`` releasing
    nothing (finished and preempted requests keep their state) fails the
    count after settling; retrieval never engaging fails the count before."""
    prompts = corpus_prompts(target_model, [600, 650, 700, 750])
    reference = target_reference(target_model, prompts, 200)
    # Target and draft each hold 4 layers x (K, V) x 2 heads x 32 dims x fp32
    # = 2 KiB per token: 96 blocks of 32 tokens (3,072 tokens) admit all four
    # prompts (2,700 tokens), but not their 800 generated tokens on top. The
    # same budget holds the tap's keys (2 heads x 32 dims x fp32 = 256 bytes
    # per token) and, with compact positions, the plain draft KV copy
    # (another 2 KiB per token).
    kv_bytes = 96 * 32 * (2 * 2048 + 256 + (2048 if draft_window else 0))
    with engine(target_model, draft_model, spec_extend=SMALL_CACHE, draft_window=draft_window,
                kv_cache_memory_bytes=kv_bytes, max_model_len=3000) as llm:
        assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == 96
        outputs = llm.generate([tokens(p) for p in prompts], greedy(200), use_tqdm=False)
        preemptions = [m.value for m in llm.get_metrics()
                       if m.name == "vllm:num_preemptions"]
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        assert preemptions and preemptions[0] > 0
        # State was made before it was released: every request was tracked
        # (the last ones to finish are released at the next step).
        figures = retrieval_metrics(llm)
        assert figures["retrievals"] > 0
        assert figures["tracked_requests"] + figures["finished_requests"] >= len(prompts)
        assert settle_and_count(llm) == 0
        assert retrieval_metrics(llm)["finished_requests"] >= len(prompts)


@DRAFT_POSITIONS
def test_aborts_max_model_len_and_many_requests(target_model, draft_model, draft_window,
                                                target_reference):
    long_prompts = corpus_prompts(target_model, [1500, 1800, 2100])
    near_limit = corpus_prompts(target_model, [4060], offset=30_000)[0]
    many = [tokens(long_prompts[i % 3][: 600 + i % 7]) for i in range(1000)]
    distinct = list({tuple(p["prompt_token_ids"]): None for p in many})
    survivor_ref = target_reference(target_model, [long_prompts[1]], 200)[0]
    # The target alone with max_model_len=4096 stops where the context is full.
    near_limit_ref = target_reference(target_model, [near_limit], 4096 - len(near_limit))[0]
    distinct = dict(zip(distinct, target_reference(target_model, distinct, 4)))

    with engine(target_model, draft_model, spec_extend=SMALL_CACHE, draft_window=draft_window,
                max_model_len=4096, enable_prefix_caching=True) as llm:
        engine_core = llm.llm_engine
        # Abort two of three long requests mid-decode.
        for i, prompt in enumerate(long_prompts):
            engine_core.add_request(f"abort-{i}", tokens(prompt), greedy(200))
        # Step until all three decode (compact positions prefill in smaller chunks).
        for _ in range(100):
            engine_core.step()
            if tracked_requests(llm) == 3:
                break
        assert tracked_requests(llm) == 3
        engine_core.abort_request(["abort-0", "abort-2"])
        finished = {}
        while engine_core.has_unfinished_requests():
            for output in engine_core.step():
                if output.finished:
                    finished[output.request_id] = output
        assert list(finished) == ["abort-1"]
        assert list(finished["abort-1"].outputs[0].token_ids) == survivor_ref

        # A request that runs into max_model_len stops there.
        out = llm.generate([tokens(near_limit)], greedy(100), use_tqdm=False)[0]
        assert len(near_limit) + len(out.outputs[0].token_ids) == 4096
        assert out.outputs[0].finish_reason == "length"
        assert list(out.outputs[0].token_ids) == near_limit_ref

        # 1,000 requests, long enough for retrieval, through one engine.
        outputs = llm.generate(many, greedy(4), use_tqdm=False)
        assert all(list(o.outputs[0].token_ids) == distinct[tuple(o.prompt_token_ids)]
                   for o in outputs)
        assert settle_and_count(llm) == 0
