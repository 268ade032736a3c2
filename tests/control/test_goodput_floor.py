"""Goodput control's promise, in simulated engines: never slower than the
target alone by more than 3%, whatever a draft forward costs and however
often its drafts are accepted; faster where drafting pays.

A simulated engine serves batches of four prefix-cached requests of 32
tokens each, one after another (as the benchmarks' batch runs do), through
``SpeculationControl``. A step costs what the engine's own breakdown shows
for such steps (``benchmarks/results/goodput-floor``): the target's forward,
a little more per verified draft, the draft's forward per draft step (run
once for the batch however many rows draft), per caught-up token; drafts are
accepted position by position at a fixed rate. The target alone decodes one
token a step. The first batch (the controller's warm-up, unpriced) is not
counted, except for a fresh engine, whose warm-up waits for its price.
Optionally a draft forward that catches up costs more the first time it runs
at a token count (``cold_catch_up``): a CPU engine's oneDNN creates a GEMM
primitive per new row count, which the step-cost model never learns as a
price (such a step is a stall to it, or clipped: the cold ones come once it
has learnt 8 steps and at catch-ups no longer than those timed).
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_specextend.control.forced_account import ForcedDraftAccount
from vllm_specextend.control.speculation_control import SpeculationControl

TARGET_STEP = 0.45
"""A 1.5B target's decode step at batch 4 x 3.7K, bf16, on a 2-core Zen 4 (s)."""
PER_DRAFT_TOKEN = 0.01
PER_CAUGHT_UP_TOKEN = 0.002
PREFILL = 0.5
BATCH, K, TOKENS, PROMPT = 4, 4, 32, 3690


def simulated_speed(draft_step: float, acceptance: float, seed: int, batches: int = 8,
                    stats: list | None = None, tokens: int = TOKENS,
                    cold_catch_up: float = 0.0, priced_warm_up: bool = False,
                    fresh: bool = False, controllers: list | None = None,
                    per_draft_token: float = PER_DRAFT_TOKEN,
                    per_caught_up_token: float = PER_CAUGHT_UP_TOKEN,
                    planning: float = 0.0) -> float:
    """Goodput control's tokens per second over the target alone's.
    ``priced_warm_up``: the warm-up waits for its price, a draft forward at
    its true share of a target step (as an engine's drafter weighs it from
    the parameters); ``fresh``: the first batch counts too; ``controllers``
    gets the controller; ``per_draft_token``, ``per_caught_up_token``:
    seconds per verified draft and per caught-up token; ``planning``:
    seconds each plan takes on the host (the target alone plans nothing)."""
    rng = np.random.default_rng(seed)
    control = SpeculationControl(BATCH, K, free_pause=True, synced_lead=1, defer_prompts=True)
    if priced_warm_up:
        control.controller.warm_up.draft_forward_share = draft_step / TARGET_STEP
    clock = [0.0]
    control.clock = lambda: clock[0]
    if planning:
        controller_plan = control.controller.plan

        def slow_plan(*args, **kwargs):
            clock[0] += planning
            return controller_plan(*args, **kwargs)

        control.controller.plan = slow_plan
    first_pass_counts = set()
    controlled = alone = 0.0
    for batch in range(batches):
        req_ids = [f"b{batch}-{row}" for row in range(BATCH)]
        prompt = np.full(BATCH, PROMPT)
        context = np.full(BATCH, PROMPT - 106)  # a prefix cache hit but its last tokens
        query = prompt - context
        output, verifying = np.zeros(BATCH, np.int64), np.zeros(BATCH, np.int64)
        start = clock[0]
        while req_ids:
            plan = control.plan_step(req_ids, context.copy(), query.copy(), prompt.copy())
            runs = plan.runs_draft_forward
            caught_up, cold = 0, 0.0
            if runs:
                starts = control.catch_up_starts(req_ids, context.copy(), 8192)
                caught_up = 0 if starts is None else int((context - starts).sum())
                first_pass = caught_up + int(query.sum())
                cost = control.controller.cost
                if (caught_up and first_pass not in first_pass_counts
                        and cost.observations >= 8 and caught_up <= cost.most_catch_up_timed):
                    first_pass_counts.add(first_pass)
                    cold = cold_catch_up
            decoding = context >= prompt
            clock[0] += (TARGET_STEP + per_draft_token * float(verifying[decoding].sum())
                         + (draft_step * plan.draft_steps if runs else 0.0)
                         + per_caught_up_token * caught_up + cold
                         + (PREFILL if not decoding.all() else 0.0))
            accepted = np.minimum(rng.geometric(1.0 - acceptance, len(req_ids)) - 1, verifying)
            context = np.where(decoding, context + accepted + 1, prompt)
            output += np.where(decoding, accepted + 1, 1)
            verifying = plan.draft_lengths if runs else np.zeros(len(req_ids), np.int64)
            query = 1 + verifying
            going = output < tokens
            req_ids = [req_id for req_id, kept in zip(req_ids, going) if kept]
            prompt, context, query, output, verifying = (
                a[going] for a in (prompt, context, query, output, verifying))
        if batch or fresh:
            controlled += clock[0] - start
            alone += PREFILL + TARGET_STEP * tokens
    if stats is not None:
        stats.append(control.controller.stats)
    if controllers is not None:
        controllers.append(control.controller)
    return alone / controlled


@pytest.mark.parametrize("draft_step", [0.05, 0.15, 0.4])
@pytest.mark.parametrize("acceptance", [0.2, 0.35, 0.5])
def test_goodput_control_holds_the_floor(draft_step, acceptance):
    speeds = [simulated_speed(draft_step, acceptance, seed) for seed in range(3)]
    assert min(speeds) >= 0.97, speeds


@pytest.mark.parametrize("draft_step", [0.05, 0.15, 0.4])
@pytest.mark.parametrize("acceptance", [0.2, 0.35, 0.5])
def test_the_floor_holds_where_verified_tokens_are_free_and_catch_ups_dear(draft_step,
                                                                           acceptance):
    # Issue #45's Zen 4 at batch 4: the cost model learnt a verified token
    # as free (the target's decode is memory-bound) and a caught-up token
    # cost ~4 ms (here 8). Admitted at a verified token's price, each probe
    # caught up all of the catch-up range: 0.968x at (0.05, 0.2).
    speeds = [simulated_speed(draft_step, acceptance, seed, per_draft_token=0.0,
                              per_caught_up_token=0.008) for seed in range(3)]
    assert min(speeds) >= 0.97, speeds


def test_planning_that_takes_the_probe_budget_leaves_nothing_for_forced_drafts():
    # A host planning beside a fast target (a GPU's decode step of ~10 ms,
    # a plan of a few hundred microseconds): every step 2% longer than the
    # target alone's. With probes and explorations on top: 0.968-0.981x.
    controllers: list = []
    speeds = [simulated_speed(0.05, 0.2, seed, planning=0.02 * TARGET_STEP,
                              controllers=controllers) for seed in range(3)]
    assert min(speeds) >= 0.97, speeds
    plans = sum(c.stats.drafted_request_steps + c.stats.paused_request_steps for c in controllers)
    assert sum(c.forced_account.host_seconds for c in controllers) >= (
        plans / BATCH * 0.02 * TARGET_STEP)


def test_a_draft_dearer_than_it_can_pay_for_is_never_run_after_the_warm_up():
    # The issue this guards (a 2-core Zen 4, bf16): every probe drafted K
    # tokens and its draft forward was priced as a quarter of what it cost.
    stats: list = []
    assert simulated_speed(0.4, 0.35, seed=0, stats=stats) == pytest.approx(1.0, abs=0.005)
    assert stats[0].probes == 0


@pytest.mark.parametrize("draft_step, acceptance, gain", [(0.05, 0.8, 1.3), (0.15, 0.8, 1.05),
                                                         (0.05, 0.5, 1.03)])
def test_goodput_control_drafts_where_drafting_pays(draft_step, acceptance, gain):
    speeds = [simulated_speed(draft_step, acceptance, seed) for seed in range(3)]
    assert min(speeds) >= gain, speeds


@pytest.mark.parametrize("draft_step", [0.05, 0.15, 0.4])
@pytest.mark.parametrize("acceptance", [0.2, 0.35, 0.5])
def test_a_fresh_engine_keeps_the_floor_in_its_first_requests(draft_step, acceptance):
    # The warm-up waits for its price: the first batch runs paused throughout.
    speeds = [simulated_speed(draft_step, acceptance, seed, batches=1, priced_warm_up=True,
                              fresh=True) for seed in range(3)]
    assert min(speeds) >= 0.97, speeds


@pytest.mark.parametrize("draft_step", [0.15, 0.4])
def test_an_unpriced_warm_up_loses_a_fresh_engine_its_first_requests(draft_step):
    # The controller as it was (goodput_warm_up "immediate"): two plans at K
    # at the first decode steps, then estimates still near their prior.
    speeds = [simulated_speed(draft_step, 0.35, seed, batches=1, fresh=True)
              for seed in range(3)]
    assert max(speeds) < 0.97, speeds


@pytest.mark.parametrize("draft_step, gain", [(0.05, 1.2), (0.15, 1.01)])
def test_a_fresh_engine_whose_warm_up_waited_drafts_where_drafting_pays(draft_step, gain):
    # Acceptance 0.8: after the warm-up (its price over 2% of a paused step:
    # ~530 plans at a draft step of 0.05) the engine drafts, and over 48
    # batches (1536 plans) it gains.
    speeds = [simulated_speed(draft_step, 0.8, seed, batches=48, priced_warm_up=True,
                              fresh=True) for seed in range(3)]
    assert min(speeds) >= gain, speeds


@pytest.mark.parametrize("seed", range(3))
def test_a_probe_costs_what_it_was_priced_at_with_the_catch_up_it_bought(seed):
    # Long paused requests probe again and again, each catching up what its
    # budget buys. Priced by the cost model as each step ran (its catch-up
    # too) they cost that: the charge is the step's measured excess.
    # (Issue #45's engine, bf16, 128 tokens: a round's probes priced 1.85 s, charged 1.83 s.)
    controllers: list = []
    simulated_speed(0.05, 0.35, seed, batches=4, tokens=256, controllers=controllers)
    account, stats = controllers[0].forced_account, controllers[0].stats
    assert stats.probes >= 40 and stats.catch_up_tokens >= 40 * 8
    assert account.priced_seconds == pytest.approx(account.excess_seconds, rel=0.25)


COLD_CATCH_UP = 3.0
"""Seconds a catch-up's first forward at a new token count adds (~7 target
steps): a machine whose oneDNN JIT is slow (an AMX Xeon's adds 2-54 ms,
``benchmarks/onednn_shapes.py``)."""


def cold_catch_up_speeds(cold_catch_up: float) -> list[float]:
    """Long requests (256 tokens), so that paused requests probe again and again."""
    return [simulated_speed(0.05, 0.35, seed, batches=4, tokens=256,
                            cold_catch_up=cold_catch_up) for seed in range(3)]


def test_probes_dearer_than_their_price_are_paid_at_what_they_measured():
    assert min(cold_catch_up_speeds(COLD_CATCH_UP)) >= 0.97


@pytest.mark.xfail(strict=True, reason="cold steps drafting on estimates are charged to no "
                   "account: 0.963-0.975x")
def test_drafts_on_estimates_dearer_than_their_price_keep_the_floor():
    # A cold forward of ~2 target steps is no stall to the cost model (4x
    # its prediction): it is learnt clipped at 1.5x. Of the 6-10 cold steps
    # per run 2-5 drafted on estimates, not forced: the account pays only
    # for the others.
    assert min(cold_catch_up_speeds(1.0)) >= 0.97


def test_probes_priced_by_the_cost_model_alone_lose_the_floor(monkeypatch):
    # The controller as it was: a probe admitted by its predicted price
    # whatever the steps it forced had measured.
    monkeypatch.setattr(ForcedDraftAccount, "settings", lambda self, settings: settings)
    assert min(cold_catch_up_speeds(COLD_CATCH_UP)) < 0.97
