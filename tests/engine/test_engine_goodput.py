"""Engine tests: goodput control (``speculation_control: "goodput"``).

A step in which nobody drafts skips the draft's forward; the tokens verified
meanwhile are caught up by the next forward, so a draft equal to the target
accepts every draft after a pause, as it does without pauses. The controller
pauses a request whose drafts are never accepted and resumes it after a probe
when they would be. Outputs stay the target's.
"""

import numpy as np
import pytest

from benchmarks.worker_hooks import control_counts, reconfigure_drafter
from tests.engine_utils import (
    SMALL_CACHE,
    corpus_prompts,
    counter_deltas,
    engine,
    generate_greedy,
    spec_decode_counters,
)

pytestmark = pytest.mark.engine

K = 3
MAX_TOKENS = 48
# The warm-up drafts at the first decode steps: these tests show the engine's
# mechanics from its first requests (a priced warm-up waits: the last test).
GOODPUT = {"speculation_control": "goodput", "goodput_warm_up": "immediate"}
# The whole cache (no retrieval): a draft equal to the target accepts everything.
FULL_CACHE_GOODPUT = {"mode": "off", **GOODPUT}


def _script_plans(worker, pause_from: int, pause_to: int) -> None:
    """Every request drafts K, except for the plans ``pause_from`` up to
    ``pause_to``: none drafts. Logs "T" per target forward, "D" per draft one."""
    _log_forwards(worker)

    def k_of_step(step):
        return 0 if pause_from <= step < pause_to else K

    _script(worker, k_of_step, draft_prefill=True)


def _script(worker, k_of_step, draft_prefill: bool) -> None:
    """Every plan: each request drafts ``k_of_step(plan number)``, and
    prompts go through the draft iff ``draft_prefill``."""
    from vllm_specextend.control.goodput import DraftPlan

    runner = worker.model_runner
    controller = runner.drafter.control.controller
    # Scripting again replaces the script (it does not wrap it).
    stock_choose = controller.__dict__.setdefault("_stock_choose", controller.choose)
    runner._test["plans"] = 0

    def scripted(req_ids, *args, **kwargs):
        stock_choose(req_ids, *args, **kwargs)  # the controller's own bookkeeping
        k = k_of_step(runner._test["plans"])
        runner._test["plans"] += 1
        return DraftPlan(np.full(len(req_ids), k), k, 0.0, draft_prefill=draft_prefill)

    controller.choose = scripted


def _script_all(worker, k: int, draft_prefill: bool) -> None:
    _log_forwards(worker)
    _script(worker, lambda step: k, draft_prefill)


def _log_forwards(worker) -> None:
    """From now on: "T" per target forward, "D" per draft one."""
    runner = worker.model_runner
    runner._test = {"plans": 0, "log": []}
    if not getattr(runner, "_test_hooked", False):
        runner._test_hooked = True
        runner.model.register_forward_pre_hook(lambda *_: runner._test["log"].append("T"))
        runner.drafter.model.register_forward_pre_hook(
            lambda *_: runner._test["log"].append("D"))


def _forward_log(worker) -> str:
    return "".join(worker.model_runner._test["log"])


def _skip_catch_up(worker) -> None:
    worker.model_runner.drafter.control.catch_up = lambda *args: None


def test_paused_steps_skip_the_draft_and_resumed_drafts_catch_up(target_model, target_reference):
    prompts = corpus_prompts(target_model, [300, 700, 1100, 1500])
    reference = target_reference(target_model, prompts, MAX_TOKENS)
    runs = {}
    with engine(target_model, target_model, k=K, spec_extend=FULL_CACHE_GOODPUT) as llm:
        assert not llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        for name in ("caught up", "not caught up"):
            if name == "not caught up":
                llm.collective_rpc(_skip_catch_up)
            llm.collective_rpc(_script_plans, args=(4, 12))
            before = spec_decode_counters(llm)
            outputs = generate_greedy(llm, prompts, MAX_TOKENS)
            runs[name] = (outputs, counter_deltas(spec_decode_counters(llm), before),
                          llm.collective_rpc(_forward_log)[0])
        control = llm.collective_rpc(control_counts)[0]
    outputs, counters, log = runs["caught up"]
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    # One target forward per step: prefill, 3 drafting steps, then 8 steps
    # with no draft forward at all, then drafting again.
    steps = log.split("T")[1:]
    assert steps[:4] == ["D" * K] * 4
    assert steps[4:12] == [""] * 8
    assert steps[12] == "D" * K
    # Every draft after the pause is accepted: the draft's KV is complete.
    assert counters["num_accepted_tokens"] == counters["num_draft_tokens"] > 0
    assert control["catch_up_tokens"] > 0
    # Without the catch-up the draft reads holes and misses.
    outputs, counters, _ = runs["not caught up"]
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    assert counters["num_accepted_tokens"] < counters["num_draft_tokens"]


def _skip_stale_blocks(worker) -> None:
    """New requests trust their prefix cache hits' draft KV (as before the
    stale-block registry)."""
    control = worker.model_runner.drafter.control
    control.kv_frontiers._first_stale = lambda row, context_len: context_len


def test_a_deferred_prompt_skips_the_draft_and_a_prefix_hit_on_it_catches_up(
    target_model, target_reference
):
    # Prompts the draft never saw (their requests paused throughout), then
    # requests sharing their first 512 tokens (32 blocks), drafting: a
    # draft equal to the target accepts every draft iff its KV is complete.
    cases = {}
    for offset, name in ((0, "caught up"), (40_000, "trusting the cache")):
        deferred = corpus_prompts(target_model, [600, 700], offset=offset)
        tails = corpus_prompts(target_model, [100, 150], offset=offset + 20_000)
        sharing = [p[:512] + t for p, t in zip(deferred, tails)]
        cases[name] = (deferred, target_reference(target_model, deferred, 16),
                       sharing, target_reference(target_model, sharing, MAX_TOKENS))
    runs = {}
    with engine(target_model, target_model, k=K, spec_extend=FULL_CACHE_GOODPUT,
                enable_prefix_caching=True) as llm:
        for name, (deferred, deferred_reference, sharing, sharing_reference) in cases.items():
            if name == "trusting the cache":
                llm.collective_rpc(_skip_stale_blocks)
            llm.collective_rpc(_script_all, args=(0, False))
            before = llm.collective_rpc(control_counts)[0]
            outputs = generate_greedy(llm, deferred, 16)
            assert [list(o.outputs[0].token_ids) for o in outputs] == deferred_reference
            log = llm.collective_rpc(_forward_log)[0]
            deferred_tokens = counter_deltas(llm.collective_rpc(control_counts)[0],
                                             before)["deferred_prefill_tokens"]
            llm.collective_rpc(_script_all, args=(K, True))
            before = spec_decode_counters(llm)
            outputs = generate_greedy(llm, sharing, MAX_TOKENS)
            assert [list(o.outputs[0].token_ids) for o in outputs] == sharing_reference
            runs[name] = (log, deferred_tokens,
                          counter_deltas(spec_decode_counters(llm), before))
    log, deferred_tokens, counters = runs["caught up"]
    # No draft forward at all: neither for the prompts nor after.
    assert "T" in log and "D" not in log
    assert deferred_tokens == 600 + 700
    assert counters["num_accepted_tokens"] == counters["num_draft_tokens"] > 0
    # Read as the draft's own, the hit blocks' KV makes it miss.
    _, _, counters = runs["trusting the cache"]
    assert counters["num_accepted_tokens"] < counters["num_draft_tokens"]


def test_prompts_skip_the_draft_once_drafting_does_not_pay(target_model, draft_model,
                                                           target_reference):
    first = corpus_prompts(target_model, [300, 400, 350, 450])
    later = corpus_prompts(target_model, [500, 600], offset=30_000)
    reference = target_reference(target_model, later, MAX_TOKENS)
    with engine(target_model, draft_model, k=K, spec_extend=FULL_CACHE_GOODPUT) as llm:
        # A draft forward costs five steps: drafting never pays. The first
        # requests show it (each number of draft steps tried once: until
        # then it looks free).
        llm.collective_rpc(_simulate_device, args=(0.010, 0.002, 0.05))
        generate_greedy(llm, first[:2], 96)
        generate_greedy(llm, first[2:], 96)
        llm.collective_rpc(_log_forwards)
        before = llm.collective_rpc(control_counts)[0]
        outputs = generate_greedy(llm, later, MAX_TOKENS)
        log = llm.collective_rpc(_forward_log)[0]
        control = counter_deltas(llm.collective_rpc(control_counts)[0], before)
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    assert control["deferred_prefill_tokens"] == 500 + 600
    assert "D" not in log and control["drafted_request_steps"] == 0


def _simulate_device(worker, step: float, per_token: float, per_draft_forward: float) -> None:
    """The controller's clock as a device with these costs would show it (a
    token the draft catches up costs a quarter of one the target verifies)."""
    control = worker.model_runner.drafter.control
    state = {"now": 0.0, "forwards": 0, "caught_up": 0}
    stock_plan = control.plan_step

    def plan(req_ids, context_lens, query_lens, prompt_lens, *args):
        caught_up = control.controller.stats.catch_up_tokens
        state["now"] += (step + per_token * int(query_lens.sum())
                         + per_token / 4 * (caught_up - state["caught_up"])
                         + per_draft_forward * state["forwards"])
        state["caught_up"] = caught_up
        result = stock_plan(req_ids, context_lens, query_lens, prompt_lens, *args)
        state["forwards"] = result.draft_steps if result.runs_draft_forward else 0
        return result

    control.clock = lambda: state["now"]
    control.plan_step = plan


def test_a_draft_that_is_never_accepted_pauses_and_resumes_after_probing(
    target_model, target_reference
):
    """Pausing and resuming observed from the draft forwards that ran (a
    forward hook on the target and the draft). Mutation: ``SpeculationControl
    .plan`` telling the adapter to run the draft's forward on the steps its
    controller counts as skipped (``return plan.draft_steps`` whatever
    ``plan.runs_draft_forward``) passes the counter checks and fails the
    observed ones."""

    # A draft equal to the target: through a 3-block working cache of a
    # random-attention target it is rarely right; with the whole cache, always.
    blind = {**SMALL_CACHE, "top_k_chunks": 0, "recent_tokens": 32, "sink_tokens": 0,
             "min_context_tokens": 0, **GOODPUT}
    prompts = corpus_prompts(target_model, [600, 900])
    reference = target_reference(target_model, prompts, 96)
    # Longer requests after the switch: most of their steps come after a probe
    # (they arrive with the blind run's probe back-off).
    later_prompts = corpus_prompts(target_model, [650, 950])
    later_reference = target_reference(target_model, later_prompts, 320)
    with engine(target_model, target_model, k=K, spec_extend=blind) as llm:
        # Verifying a token costs a fifth of a step, a draft forward a tenth:
        # drafting pays when drafts are accepted.
        llm.collective_rpc(_simulate_device, args=(0.010, 0.002, 0.001))
        # Prompts run through the draft: requests that arrive paused after the
        # blind run would defer theirs, and a probe catching all of it up
        # costs more than their budget here (deferral: the tests above).
        llm.collective_rpc(_defer_prompts, args=(False,))
        llm.collective_rpc(_log_forwards)
        before = spec_decode_counters(llm)
        outputs = generate_greedy(llm, prompts, 96)
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        blind_acceptance = counter_deltas(spec_decode_counters(llm), before)
        blind_run = llm.collective_rpc(control_counts)[0]
        blind_steps = llm.collective_rpc(_forward_log)[0].split("T")[1:]
        llm.collective_rpc(reconfigure_drafter, args=({**blind, "mode": "off"},))
        llm.collective_rpc(_log_forwards)
        outputs = generate_greedy(llm, later_prompts, 320)
        assert [list(o.outputs[0].token_ids) for o in outputs] == later_reference
        seeing_run = counter_deltas(llm.collective_rpc(control_counts)[0], blind_run)
        seeing_steps = llm.collective_rpc(_forward_log)[0].split("T")[1:]
    assert blind_acceptance["num_accepted_tokens"] < 0.5 * blind_acceptance["num_draft_tokens"]
    # Blind: paused but for warm-up, exploration and probes.
    assert blind_run["paused_request_steps"] > 3 * blind_run["drafted_request_steps"]
    assert blind_run["skipped_draft_forwards"] > 0 and blind_run["probes"] > 0
    # Seeing: a probe or an exploration (each when its budget, 2% of the
    # paused time, covers it) finds the drafts right and the requests draft
    # again, at full K.
    assert seeing_run["drafted_request_steps"] > seeing_run["paused_request_steps"]
    lengths = seeing_run["chosen_draft_lengths"]
    assert lengths[K] > lengths[0] and lengths[K] > sum(lengths[1:K])
    # What the draft actually ran, one entry per target forward: "" where its
    # forward was skipped, "D" per draft forward otherwise (measured: blind,
    # 89 of 93 steps skipped).
    assert blind_steps.count("") == blind_run["skipped_draft_forwards"]
    assert seeing_steps.count("") == seeing_run["skipped_draft_forwards"]
    assert blind_steps.count("") > 0.8 * len(blind_steps)
    # Seeing: still paused at first (the blind run's back-off), then resumed:
    # the draft runs at every step from its first K-deep forward on, K deep,
    # but for an exploration's pause (measured: 51 skipped, then 69 steps
    # drafting K deep, one exploration's pause, 7 more).
    first_resumed = seeing_steps.index("D" * K)
    assert first_resumed >= 40
    resumed = seeing_steps[first_resumed:]
    assert len(resumed) >= 60 and resumed.count("") <= seeing_run["explorations"]
    assert resumed.count("D" * K) >= 0.85 * len(resumed)


@pytest.mark.parametrize("draft_window", [None, 1024], ids=["cmr", "compact"])
def test_goodput_control_with_retrieval_equals_target_alone(draft_window, target_model,
                                                            draft_model, target_reference):
    prompts = corpus_prompts(target_model, [150, 1200, 3000, 600])
    reference = target_reference(target_model, prompts, MAX_TOKENS)
    options = {**SMALL_CACHE, **GOODPUT}
    if draft_window:
        options.update(top_k_chunks=2, recent_tokens=256, min_context_tokens=512)
    with engine(target_model, draft_model, k=K, spec_extend=options,
                draft_window=draft_window, enable_prefix_caching=True) as llm:
        for _ in range(2):
            outputs = generate_greedy(llm, prompts, MAX_TOKENS)
            assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        control = llm.collective_rpc(control_counts)[0]
        limits = llm.collective_rpc(_output_limits)[0]
    assert control["drafted_request_steps"] > 0 and control["paused_request_steps"] > 0
    # Each request's max_tokens reached the controller when it arrived.
    assert limits.count(MAX_TOKENS) >= len(prompts)


def _output_limits(worker) -> list[int]:
    return worker.model_runner.drafter.control.controller.state.max_output_tokens.tolist()


def _defer_prompts(worker, defer: bool) -> None:
    worker.model_runner.drafter.control.controller.defer_prompts = defer


def _forward_paused_steps(worker, forward: bool) -> None:
    """Run the draft's forward on steps where nobody drafts (stock vLLM's
    K=0 steps) instead of skipping it."""
    worker.model_runner.drafter.control.controller.free_pause = not forward


def _record_drafts(worker) -> None:
    drafter = worker.model_runner.drafter
    drafter._test_drafts = []
    propose = type(drafter).propose

    def recording(*args, **kwargs):
        drafts = propose(drafter, *args, **kwargs)
        drafter._test_drafts.append(drafts.tolist())
        return drafts

    drafter.propose = recording


def _drafts(worker) -> list:
    return worker.model_runner.drafter._test_drafts


def test_a_paused_eagle3_head_skips_its_forward_and_catches_up_exactly(target_reference):
    from tests.eagle_heads import build_trained_eagle_head
    from tests.tiny_models import TARGET_LLAMA, build_damped_attention_copy

    target = build_damped_attention_copy(TARGET_LLAMA, 0.05)
    head = build_trained_eagle_head(target, kind="eagle3", window=512)
    prompts = corpus_prompts(target, [150, 300, 420, 250])
    reference = target_reference(target, prompts, MAX_TOKENS)
    runs = {}
    # Retrieval off (its options only need to fit the head's window): the
    # head attends to everything, within its window.
    options = {**FULL_CACHE_GOODPUT, "top_k_chunks": 2, "recent_tokens": 256}
    with engine(target, head, method="eagle3", k=K, spec_extend=options,
                max_model_len=512) as llm:
        for name in ("free pauses", "stock pauses", "not caught up"):
            llm.collective_rpc(_forward_paused_steps, args=(name == "stock pauses",))
            if name == "not caught up":
                llm.collective_rpc(_skip_catch_up)
            llm.collective_rpc(_script_plans, args=(4, 12))
            llm.collective_rpc(_record_drafts)
            outputs = generate_greedy(llm, prompts, MAX_TOKENS)
            assert [list(o.outputs[0].token_ids) for o in outputs] == reference, name
            runs[name] = (llm.collective_rpc(_drafts)[0], llm.collective_rpc(_forward_log)[0])
        control = llm.collective_rpc(control_counts)[0]
    drafts, log = runs["free pauses"]
    steps = log.split("T")[1:]
    # The head's K forwards per drafting step, none while paused.
    assert steps[:4] == ["D" * K] * 4
    assert steps[4:12] == [""] * 8
    assert steps[12] == "D" * K
    assert control["catch_up_tokens"] > 0
    # Stock pauses run the head's first pass every step: its KV stays
    # complete. Caught up from the kept hidden states, the head drafts
    # exactly what it drafts then, every step after the pause.
    stock_drafts, stock_log = runs["stock pauses"]
    assert stock_log.split("T")[5:13] == ["D"] * 8
    assert drafts[12:] == stock_drafts[12:] and any(drafts[12:])
    # Without the catch-up the head reads holes and drafts otherwise.
    assert runs["not caught up"][0][12:] != stock_drafts[12:]


def test_goodput_control_with_a_head_at_compact_positions_equals_target_alone(target_reference):
    from tests.eagle_heads import build_trained_eagle_head
    from tests.tiny_models import TARGET_LLAMA, build_damped_attention_copy

    target = build_damped_attention_copy(TARGET_LLAMA, 0.05)
    head = build_trained_eagle_head(target, kind="eagle3", window=512)
    prompts = corpus_prompts(target, [1500, 3000, 2200, 1800])
    reference = target_reference(target, prompts, MAX_TOKENS)
    # Past the head's window of 512: cmr at compact positions.
    options = {"top_k_chunks": 2, "sink_tokens": 32, "recent_tokens": 256,
               "min_context_tokens": 512, **GOODPUT}
    with engine(target, head, method="eagle3", k=K, spec_extend=options,
                enable_prefix_caching=True) as llm:
        # Drafting costs as much as verifying: the head pauses, then probes.
        llm.collective_rpc(_simulate_device, args=(0.010, 0.002, 0.004))
        for _ in range(2):
            outputs = generate_greedy(llm, prompts, MAX_TOKENS)
            assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        control = llm.collective_rpc(control_counts)[0]
    assert control["drafted_request_steps"] > 0 and control["paused_request_steps"] > 0
    assert control["skipped_draft_forwards"] > 0 and control["catch_up_tokens"] > 0


def _warm_up_state(worker) -> dict:
    warm_up = worker.model_runner.drafter.control.controller.warm_up
    return {"share": warm_up.draft_forward_share, "pending": warm_up.pending}


def test_a_fresh_engine_prices_its_warm_up_by_the_draft_parameters_and_waits(
        target_model, draft_model, target_reference):
    # The default warm-up: the noisy copy has the target's parameters (share
    # 1), so its price (2 x K draft forwards, 2 x K drafts verified per row,
    # the catch-up) is over 4K paused steps of credit, at 2% of a step a
    # plan: over 200 x K plans, more than these requests decode.
    prompts = corpus_prompts(target_model, [150, 1200, 3000, 600])
    reference = target_reference(target_model, prompts, MAX_TOKENS)
    with engine(target_model, draft_model, k=K,
                spec_extend={**SMALL_CACHE, "speculation_control": "goodput"}) as llm:
        outputs = generate_greedy(llm, prompts, MAX_TOKENS)
        control = llm.collective_rpc(control_counts)[0]
        state = llm.collective_rpc(_warm_up_state)[0]
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    assert state == {"share": pytest.approx(1.0), "pending": True}
    assert control["drafted_request_steps"] == 0
    assert control["paused_request_steps"] >= len(prompts) * (MAX_TOKENS - 2)
