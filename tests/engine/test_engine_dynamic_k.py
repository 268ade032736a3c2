"""vLLM's K by batch size (``num_speculative_tokens_per_batch_size``) with
SpecExtend. While 3 or more requests run the schedule drafts nothing (K=0);
vLLM still runs the draft's first pass on the verified tokens, through our
compacted view, so when drafting resumes the draft's KV holds every token."""

import re

import pytest

from tests.engine_utils import corpus_prompts, engine, retrieval_metrics, spec_decode_counters
from tests.tiny_models import TARGET_LLAMA, build_damped_attention_copy

pytestmark = pytest.mark.engine

K = 3
SCHEDULE = [(1, 2, K), (3, 8, 0)]
OPTIONS = {"top_k_chunks": 2, "sink_tokens": 32, "recent_tokens": 256,
           "min_context_tokens": 256}
# Two requests leave after 24 tokens; the other two go on, then with drafts.
MAX_TOKENS = [24, 24, 64, 64]


def generate(llm, prompts, max_tokens):
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _record_forwards(worker) -> None:
    """Log "T" for each target forward and "D" for each draft forward."""
    runner = worker.model_runner
    runner._forward_log = []
    runner.model.register_forward_pre_hook(lambda *_: runner._forward_log.append("T"))
    runner.drafter.model.register_forward_pre_hook(lambda *_: runner._forward_log.append("D"))


def _forward_log(worker) -> str:
    return "".join(worker.model_runner._forward_log)


def acceptance_rate(counters) -> float:
    return counters["num_accepted_tokens"] / counters["num_draft_tokens"]


def test_k_by_batch_size_keeps_outputs_and_the_drafts_kv(target_reference):
    # Damped attention and a draft with the target's weights: the draft
    # agrees with the target whenever it sees the recent tokens' KV.
    target_model = draft_model = build_damped_attention_copy(TARGET_LLAMA, 0.05)
    prompts = corpus_prompts(target_model, [2500, 2600, 2700, 2800])
    target_alone = [tokens[:n] for tokens, n in zip(
        target_reference(target_model, prompts, max(MAX_TOKENS)), MAX_TOKENS)]
    # Reference: the two long-running requests alone, drafting K=3 throughout.
    with engine(target_model, draft_model, k=K, spec_extend=OPTIONS) as llm:
        assert generate(llm, prompts[2:], MAX_TOKENS[2:]) == target_alone[2:]
        always = spec_decode_counters(llm)
    with engine(target_model, draft_model, k=K, spec_extend=OPTIONS,
                speculative_config_extra={"num_speculative_tokens_per_batch_size": SCHEDULE},
                ) as llm:
        llm.collective_rpc(_record_forwards)
        assert generate(llm, prompts, MAX_TOKENS) == target_alone
        forwards = llm.collective_rpc(_forward_log)[0]
        scheduled = spec_decode_counters(llm)
        retrieval = retrieval_metrics(llm)
    # No drafts while four requests ran: fewer drafted tokens than the
    # reference, which drafted for the same two requests from their start.
    # (The tiny models' acceptance barely depends on the recent KV, so the
    # forward log below, not acceptance, shows the draft's cache is whole.)
    assert 0 < scheduled["num_draft_tokens"] < always["num_draft_tokens"]
    # Drafting resumed over a complete KV cache: the draft agrees with the
    # target as often as when it never paused.
    assert acceptance_rate(scheduled) >= 0.8 * acceptance_rate(always)
    # The draft's KV after steps without drafts: every target step, K=0 ones
    # included, is followed by the draft's pass over the verified tokens
    # (through the compacted view), so no token is missing from its cache.
    # E.g. "TDDD TD TD ... TD TDDD TDDD ...": K=3 (3 draft passes), then K=0.
    assert forwards.startswith("T") and "TT" not in forwards
    assert len(re.findall(r"TD(?=T)", forwards)) >= 20  # the steps with K=0
    assert retrieval["retrievals"] > 0
