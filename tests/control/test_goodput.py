"""The goodput controller (``control/goodput.py``) against simulated engines."""

import numpy as np
import pytest
import torch

from vllm_specextend.control.draft_warm_up import WARM_UP
from vllm_specextend.control.goodput import (
    AcceptanceEstimates,
    ControlParameters,
    GoodputController,
    StepCostModel,
    StepOutcome,
    choose_draft_lengths,
    step_features,
)

K = 3


def fitted(weights: dict[str, float]) -> StepCostModel:
    """A cost model that has learnt ``weights`` (seconds per feature unit;
    ``draft_forwards``: seconds per draft step, linear in ``D``)."""
    model = StepCostModel(K)
    per_forward = weights.get("draft_forwards", 0.0)
    model.weights = np.array([weights.get(name, 0.0)
                              for name in ("step", "verified_tokens", "catch_up_tokens")]
                             + [d * per_forward for d in range(1, K + 1)])
    model.observations = 100
    return model


def test_the_cost_model_learns_a_step_cost_per_number_of_draft_steps():
    # Not linear in D (as measured on a CPU at batch 1): one draft step costs
    # more than two.
    # A token caught up after a pause costs 3 ms.
    truth = np.array([0.050, 0.004, 0.003, 0.080, 0.030, 0.090])
    model = StepCostModel(K, forgetting=1.0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        requests = int(rng.integers(1, 16))
        drafts = int(rng.integers(0, K + 1))
        catch_up = int(rng.integers(0, 64)) if drafts and rng.random() < 0.2 else 0
        features = step_features(requests + int(rng.integers(0, requests * drafts + 1)), drafts,
                                 K, catch_up)
        model.observe(features, float(features @ truth))
    for probe in (step_features(20, 2, K), step_features(3, 1, K, 40), step_features(5, 0, K)):
        assert model.predict(probe) == pytest.approx(probe @ truth, rel=5e-3)
    assert model.weights == pytest.approx(truth, rel=0.05)


@pytest.mark.parametrize("piecewise_step", [False, True])
def test_the_compiled_fit_is_the_ridge_regressions_solution(piecewise_step):
    # The numpy formulation it replaced, step by step: the same Gram matrix
    # and moments bit for bit; LAPACK's solve within rounding.
    model = StepCostModel(K, piecewise_step=piecewise_step)
    gram, moment = np.zeros_like(model._gram), np.zeros_like(model._moment)
    weights = np.zeros_like(model.weights)
    clipped = False
    rng = np.random.default_rng(int(piecewise_step))
    for _ in range(300):
        features = model.features(int(rng.integers(1, 400)), int(rng.integers(0, K + 1)),
                                  int(rng.integers(0, 50)) * int(rng.random() < 0.3),
                                  bool(rng.random() < 0.5))
        # Costs that a linear model misses, so that some weights clip at 0.
        seconds = float(rng.uniform(0.001, 0.1))
        model.observe(features, seconds)
        gram = model.forgetting * gram + np.outer(features, features)
        moment = model.forgetting * moment + features * seconds
        ridge = model.ridge * max(float(np.trace(gram)), 1.0)
        weights = np.linalg.solve(gram + ridge * np.eye(len(features)),
                                  moment + ridge * weights)
        clipped |= (weights[:3] < 0).any()
        weights[:3] = np.maximum(weights[:3], 0.0)
        if piecewise_step:
            weights[-1] = max(weights[-1], 0.0)
        # Untimed numbers of draft steps: priced per step as the most timed.
        timed = np.flatnonzero(model.seen[3:3 + K])
        if timed.size:
            most = int(timed[-1]) + 1
            for steps in range(1, K + 1):
                if not model.seen[2 + steps]:
                    weights[2 + steps] = weights[2 + most] / most * steps
        assert np.array_equal(model._gram, gram) and np.array_equal(model._moment, moment)
        assert model.weights == pytest.approx(weights, rel=1e-6, abs=1e-12)
        weights = model.weights.copy()  # each step from the same start
    assert clipped  # the clipping was exercised


def test_drafting_that_does_not_pay_is_switched_off():
    # A draft forward costs more than the target's step: even sure drafts
    # cannot pay (k + 1 tokens for more than k + 1 steps' time).
    expensive = fitted({"step": 0.05, "verified_tokens": 0.001, "draft_forwards": 0.06})
    sure = np.ones((4, K))
    plan = choose_draft_lengths(sure, np.ones(4, bool), expensive, 4)
    assert plan.draft_steps == 0 and not plan.draft_lengths.any()
    # A cheap draft: sure drafts pay at full K.
    cheap = fitted({"step": 0.05, "verified_tokens": 0.001, "draft_forwards": 0.002})
    plan = choose_draft_lengths(sure, np.ones(4, bool), cheap, 4)
    assert plan.draft_steps == K and (plan.draft_lengths == K).all()


def test_rows_draft_as_far_as_their_acceptance_pays():
    # Verifying a token costs 10 ms on top of a 50 ms step: a position pays
    # when its acceptance probability beats goodput x 10 ms.
    model = fitted({"step": 0.05, "verified_tokens": 0.01, "draft_forwards": 0.001})
    survival = np.cumprod(np.array([[0.95, 0.9, 0.9], [0.0, 0.0, 0.0], [0.9, 0.5, 0.1]]),
                          axis=1)
    plan = choose_draft_lengths(survival, np.ones(3, bool), model, 3)
    assert plan.draft_lengths.tolist() == [3, 0, 1]
    assert plan.draft_steps == 3

    # The chosen plan beats every uniform one.
    def goodput(lengths):
        positions = np.arange(K)
        gained = 3 + (survival * (positions < np.array(lengths)[:, None])).sum()
        seconds = model.predict(step_features(3 + sum(lengths), max(lengths), K))
        return gained / seconds
    assert plan.expected_goodput == pytest.approx(goodput(plan.draft_lengths))
    assert all(plan.expected_goodput >= goodput([k] * 3) for k in range(K + 1))


def test_a_row_drafts_when_its_drafts_are_worth_more_than_its_catch_up():
    # Two rows alike, but the second must first catch up a pause.
    model = fitted({"step": 0.05, "verified_tokens": 0.004, "draft_forwards": 0.01})
    survival = np.cumprod(np.full((2, K), 0.8), axis=1)
    paused = np.zeros(2, bool)
    plan = choose_draft_lengths(survival, paused, model, 2)
    assert (plan.draft_lengths == K).all()
    plan = choose_draft_lengths(survival, paused, model, 2, resume_seconds=np.array([0.0, 0.2]))
    assert plan.draft_lengths[0] > 0 and plan.draft_lengths[1] == 0
    # Spread over enough steps, the catch-up is worth it.
    plan = choose_draft_lengths(survival, paused, model, 2,
                                resume_seconds=np.array([0.0, 0.2 / 50]))
    assert (plan.draft_lengths == K).all()


def test_a_probe_drafts_the_one_token_it_is_priced_at():
    # A paused row (its catch-up costs more than its drafts are worth) with
    # stale, sure estimates and draft steps almost free: on estimates alone
    # it would draft K, but a probe is priced at one draft and one share of
    # the draft forward, so it drafts one, however likely its later ones.
    model = fitted({"step": 0.05, "verified_tokens": 0.004, "draft_forwards": 1e-5})
    survival = np.ones((2, K))
    resume = np.array([1.0, 1.0])
    plan = choose_draft_lengths(survival, np.zeros(2, bool), model, 2, resume_seconds=resume,
                                must_draft=np.array([True, False]))
    assert plan.draft_lengths.tolist() == [1, 0] and plan.draft_steps == 1
    # Beside a row that drafts on its estimates, it still drafts one.
    plan = choose_draft_lengths(survival, np.zeros(2, bool), model, 2,
                                resume_seconds=np.array([1.0, 0.0]),
                                must_draft=np.array([True, False]))
    assert plan.draft_lengths.tolist() == [1, K]
    # Even where its estimates alone would have it draft K (no catch-up).
    plan = choose_draft_lengths(survival, np.zeros(2, bool), model, 2,
                                must_draft=np.array([True, False]))
    assert plan.draft_lengths.tolist() == [1, K]


def test_hysteresis_keeps_a_row_on_its_side_of_the_threshold():
    model = fitted({"step": 0.05, "verified_tokens": 0.01, "draft_forwards": 0.001})
    # The acceptance near the break-even point of the first position.
    survival = np.zeros((2, K))
    for rate in np.linspace(0.05, 0.6, 56):
        survival[:, 0] = rate
        plan = choose_draft_lengths(survival, np.array([True, False]), model, 2,
                                    pause_margin=0.0)
        if plan.draft_lengths[0] and not plan.draft_lengths[1]:
            break
    else:
        pytest.fail("no acceptance keeps the drafting row but not the paused one")


def test_acceptance_estimates_follow_each_position():
    estimates = AcceptanceEstimates(max_num_reqs=2, num_positions=K, smoothing=0.5, prior=0.5)
    for _ in range(10):
        # Row 0 always accepts the first draft and rejects the second.
        estimates.observe(np.array([0]), np.array([K]), np.array([1]))
    rates = estimates.rates[0]
    assert rates[0] > 0.99 and rates[1] < 0.01
    assert rates[2] == 0.5  # never tried: the second was always rejected
    estimates.start(1)  # a new request starts from the engine's estimate
    assert estimates.rates[1][0] > 0.99


class SimulatedEngine:
    """Step time and acceptance of a batch of decoding requests, as an engine
    would show them to the controller."""

    def __init__(self, controller, acceptance, step=0.05, per_token=0.005, draft_step=0.01,
                 step_seconds=None, catch_up=0.0, long_catch_up=(0, 0.0)):
        """``step_seconds``: seconds of a step by its number of draft steps
        (instead of the linear costs); ``catch_up``: seconds per token a
        draft forward catches up (tokens verified while it paused);
        ``long_catch_up``: ``(tokens, seconds)``, each token a step catches
        up beyond ``tokens`` costs ``seconds`` more (a CPU draft's forward
        turning compute-bound)."""
        self.long_catch_up = long_catch_up
        self.controller = controller
        self.step_seconds = step_seconds
        self.acceptance = dict(acceptance)  # request -> acceptance per position
        self.context = {r: 1000 for r in acceptance}
        self.query = {r: 1 for r in acceptance}
        self.gap = {r: 0 for r in acceptance}
        self.costs = (step, per_token, draft_step, catch_up)
        self.now = 0.0
        self.draft_forwards = 0
        self.caught_up = 0
        self.history = []
        self.whole = set()
        """Requests whose forced drafts must catch up all of their gap."""

    def step(self):
        req_ids = list(self.acceptance)
        context = np.array([self.context[r] for r in req_ids])
        query = np.array([self.query[r] for r in req_ids])
        step, per_token, draft_step, catch_up = self.costs
        if self.step_seconds is not None:
            self.now += self.step_seconds[self.draft_forwards]
        else:
            self.now += step + per_token * query.sum() + draft_step * self.draft_forwards
        self.now += catch_up * self.caught_up
        self.now += self.long_catch_up[1] * max(self.caught_up - self.long_catch_up[0], 0)
        for r in req_ids:
            self.gap.setdefault(r, 0)
        gaps = np.array([max(self.gap[r], 0) for r in req_ids])
        plan = self.controller.plan(req_ids, context, query, np.ones(len(req_ids)), self.now,
                                    catch_up_gaps=gaps,
                                    whole_catch_up=np.array([r in self.whole for r in req_ids]))
        self.draft_forwards = plan.draft_steps  # a step with no drafts skips the forward
        self.controller.observe(StepOutcome(draft_forwards=plan.draft_steps))
        limits = plan.catch_up_limits
        self.caught_up = 0
        for row, (r, drafts) in enumerate(zip(req_ids, plan.draft_lengths)):
            self.gap.setdefault(r, 0)
            if plan.draft_steps:
                limit = self.gap[r] if limits is None else int(limits[row])
                self.caught_up += min(self.gap[r], limit)
                if limit >= self.gap[r]:
                    self.gap[r] = -1  # this step's token is written too
                    self.whole.discard(r)
            # This step verifies the drafts of the previous plan.
            verified = self.query[r] - 1
            accepted = verified if self.acceptance[r] >= 0.5 else 0
            self.context[r] += 1 + accepted
            self.gap[r] += 1 + accepted
            self.query[r] = 1 + int(drafts)
        if self.caught_up:
            self.controller.observe(StepOutcome(catch_up_tokens=self.caught_up))
        self.history.append(dict(zip(req_ids, plan.draft_lengths.tolist())))
        return plan


def test_a_request_whose_drafts_are_never_accepted_pauses_and_resumes_after_probing():
    controller = GoodputController(max_num_reqs=4, num_speculative_tokens=K, free_pause=True,
                                   parameters=ControlParameters(probe_interval=8))
    engine = SimulatedEngine(controller, {"good": 1.0, "bad": 0.0})
    for _ in range(40):
        engine.step()
    steady = engine.history[10:]
    # "bad" pauses but for its probes; "good" drafts K but for exploration.
    assert sum(h["bad"] == 0 for h in steady) >= 0.8 * len(steady)
    assert sum(h["good"] == K for h in steady) >= len(steady) - 2
    assert controller.stats.probes > 0
    # The draft starts agreeing: the next probe (they back off, 8 then 16,
    # 32 ... paused steps apart) sees it and the request resumes, up to K.
    engine.acceptance["bad"] = 1.0
    for _ in range(60):
        engine.step()
    assert engine.history[-1]["bad"] == K


def test_a_resumed_request_drafts_the_number_of_steps_that_pays_even_if_fewer_do_not():
    # Step seconds by draft steps as measured at batch 1 on a CPU (bf16 Qwen
    # pair, K=2): one draft costs more than two (a 2-token verification is
    # slower than a 3-token one). Paused, the request is probed with one
    # draft; a cost per draft forward, fitted on those probes, would price
    # two drafts at 0.38 s and never resume.
    controller = GoodputController(max_num_reqs=2, num_speculative_tokens=2, free_pause=True,
                                   parameters=ControlParameters(probe_interval=8))
    engine = SimulatedEngine(controller, {"r": 0.0}, step_seconds={0: 0.121, 1: 0.25, 2: 0.2})
    for _ in range(60):
        engine.step()
    assert sum(h["r"] == 0 for h in engine.history[10:]) >= 40
    engine.acceptance["r"] = 1.0
    # A probe costs a step more than a pause: the 2% budget probes every ~54.
    for _ in range(150):
        engine.step()
    steady = engine.history[-30:]
    assert sum(h["r"] == 2 for h in steady) >= len(steady) - 2


def test_requests_arriving_after_failed_probes_start_with_their_back_off():
    # No exploration steps: probes alone decide when a paused request drafts.
    controller = GoodputController(max_num_reqs=4, num_speculative_tokens=K, free_pause=True,
                                   parameters=ControlParameters(probe_interval=8,
                                                                explore_interval=10_000))
    engine = SimulatedEngine(controller, {"a": 0.0, "b": 0.0})
    # (The first probe waits for its budget: a caught-up token is priced as
    # a verified one until a catch-up is timed.)
    for _ in range(300):
        engine.step()
    assert controller.stats.probes > 0
    # The next requests: probed no sooner than the last failed probe's
    # back-off (64 paused steps here), not after the interval of 8.
    controller.finish(["a", "b"])
    engine.acceptance = {"c": 0.0, "d": 0.0}
    engine.context, engine.query = {"c": 1000, "d": 1000}, {"c": 1, "d": 1}
    probes = controller.stats.probes
    for _ in range(40):
        engine.step()
    assert controller.stats.probes == probes
    # Once requests draft on their estimates again, an arrival drafts within
    # the interval (here at once: the engine's estimates say drafts pay).
    engine.acceptance["c"] = engine.acceptance["d"] = 1.0
    for _ in range(200):
        engine.step()
    assert engine.history[-1]["c"] and engine.history[-1]["d"]
    controller.finish(["d"])
    del engine.acceptance["d"]
    engine.acceptance["e"] = 0.0
    engine.context["e"], engine.query["e"] = 1000, 1
    for _ in range(8):
        engine.step()
    assert any(h["e"] for h in engine.history[-8:])


@pytest.mark.parametrize("per_token", [0.005, 0.0])
def test_probes_and_their_catch_up_cost_at_most_the_probe_budget(per_token):
    # A token caught up costs a quarter of a request's share of a step (as a
    # 0.5B draft's against a 1.5B target's decode at batch 4 on a CPU): a
    # probe catching up all of a pause would cost a quarter of its length.
    # A verified token free (a memory-bound decode: issue #45's Zen 4 learnt
    # it so): a caught-up one is still priced at what it costs.
    paused_step = 0.05 + 4 * per_token

    def run(probe_budget, steps=600):
        controller = GoodputController(max_num_reqs=4, num_speculative_tokens=K,
                                       free_pause=True,
                                       parameters=ControlParameters(probe_budget=probe_budget))
        engine = SimulatedEngine(controller, {r: 0.0 for r in "abcd"}, per_token=per_token,
                                 catch_up=0.0045)
        forced = []  # tokens caught up by each step that drafts
        for step in range(100 + steps):
            if step == 100:
                start, probes = engine.now, controller.stats.probes
            engine.step()
            if engine.draft_forwards:
                forced.append(engine.caught_up)
        overhead = (engine.now - start) / (steps * paused_step) - 1
        return overhead, controller.stats.probes - probes, forced, engine

    overhead, probes, forced, engine = run(0.02)
    assert probes > 0 and forced and engine.controller.stats.explorations > 0
    assert overhead <= 0.03
    # Each catches up a few recent tokens of gaps of 100+, the first ones too
    # (before a catch-up is timed, a probe catches up the least).
    assert max(forced) <= 4 * 16
    # Without a budget, probes catch up every paused token: 4 times the cost.
    overhead_unbudgeted, *_ = run(1.0)
    assert overhead_unbudgeted > 4 * overhead
    # The drafts start agreeing: a probe sees it, the requests resume (and
    # then catch up in full).
    engine.acceptance = {r: 1.0 for r in "abcd"}
    for _ in range(400):
        engine.step()
    assert engine.history[-1] == {r: K for r in "abcd"}
    assert all(gap <= K + 1 for gap in engine.gap.values())


def test_a_paused_request_at_batch_1_is_probed_within_its_budget():
    # Batch 1, a cheap draft (as the 0.5B beside the 1.5B target with K=2 on
    # a CPU): a paused step costs 60 ms, a draft forward 24 ms, a verified
    # token 4 ms. Every paused step verifies one token, so the cost model
    # cannot split the base from a token's cost and puts half the step on
    # each: a verified token looks like 30 ms. Priced at that, the first
    # probe's catch-up (8 tokens) needed about 220 paused steps of budget.
    controller = GoodputController(max_num_reqs=1, num_speculative_tokens=K, free_pause=True)
    engine = SimulatedEngine(controller, {"r": 0.0}, step=0.056, per_token=0.004,
                             draft_step=0.024, catch_up=0.0005)
    for _ in range(20):  # the draft's first guesses fail: it pauses
        engine.step()
    assert engine.history[-1]["r"] == 0
    assert controller.cost.weights[1] > 0.02  # a token's cost, overstated
    engine.acceptance["r"] = 1.0
    for _ in range(160):
        engine.step()
    assert controller.stats.probes > 0
    # A probe (one draft, what it is priced at) saw the drafts agree: the
    # request drafts on its estimates, and up to K once an exploration
    # tried the positions its probes never reached.
    drafts = [h["r"] for h in engine.history[20:]]
    assert drafts[drafts.index(next(d for d in drafts if d))] == 1
    assert [h["r"] for h in engine.history[-10:]] == [K] * 10
    # Drafting on, each step catches up only the tokens of the one before.
    assert engine.caught_up <= K + 1


def deferred_prompt_engine(gap, growth=ControlParameters.catch_up_growth, long_catch_up=(0, 0.0),
                           started=None):
    """Batch 1: "a" pauses for 400 steps, its probes timing catch-ups (up to
    74 tokens). Then "b" arrives without its prompt in the draft (deferred:
    ``gap`` tokens behind) while its drafts would agree (``long_catch_up``:
    :class:`SimulatedEngine`'s). Returns the engine and each of b's draft
    forwards: (tokens caught up, gap before); ``started``: a list the clock
    at b's arrival is appended to."""
    controller = GoodputController(max_num_reqs=2, num_speculative_tokens=K, free_pause=True,
                                   parameters=ControlParameters(catch_up_growth=growth))
    engine = SimulatedEngine(controller, {"a": 0.0}, step=0.056, per_token=0.004,
                             draft_step=0.024, catch_up=0.0005, long_catch_up=long_catch_up)
    for _ in range(400):
        engine.step()
    assert controller.stats.probes > 0
    assert controller.cost.most_catch_up_timed == 74 or growth != ControlParameters.catch_up_growth
    del engine.acceptance["a"]
    engine.acceptance["b"] = 1.0
    engine.context["b"], engine.query["b"], engine.gap["b"] = 1200 + gap, 1, gap
    engine.whole.add("b")
    if started is not None:
        started.append(engine.now)
    drafted = []
    for _ in range(600):
        gap = engine.gap["b"]
        engine.step()
        if engine.draft_forwards:
            drafted.append((engine.caught_up, gap))
    return engine, drafted


def test_a_request_whose_draft_lacks_its_prompt_is_probed_with_all_of_it():
    # A probe catching up only recent tokens would read a draft without the
    # prompt: "b" is probed once its budget covers all of its gap (40
    # tokens and those verified meanwhile, within twice the 74 timed), and it
    # catches all of it up.
    engine, drafted = deferred_prompt_engine(40)
    first_catch_up, gap = drafted[0]
    assert first_catch_up == gap > 40
    assert [h["b"] for h in engine.history[-10:]] == [K] * 10


@pytest.mark.parametrize("growth", [ControlParameters.catch_up_growth, 10**9])
def test_no_catch_up_far_longer_than_any_timed_is_priced_as_those_timed(growth):
    # Issue #45's 8 x 4K point: a deferred prompt was caught up at the
    # per-token price learnt on short catch-ups (seconds, priced at
    # milliseconds); here a catch-up beyond 80 tokens costs 5 ms a token
    # more (compute-bound). Within the catch-up range (twice the 74 tokens
    # timed) "b" (4,000 tokens behind) is neither probed nor resumed on
    # its estimates (beyond the range a token is priced as a verified one):
    # the 600 steps cost what paused ones do. Without the range (growth
    # unbounded) it resumes, and that one step costs 20 s.
    start = []
    engine, drafted = deferred_prompt_engine(4000, growth, long_catch_up=(80, 0.005),
                                             started=start)
    seconds = engine.now - start[0]
    if growth == ControlParameters.catch_up_growth:
        assert drafted == []
        assert seconds < 1.03 * 600 * 0.060  # a paused step: 56 ms + one token's 4
    else:
        first_catch_up, gap = drafted[0]
        assert first_catch_up == gap >= 4000
        assert seconds > 600 * 0.060 + 19.0


def test_one_slow_step_does_not_price_a_number_of_draft_steps_out():
    # Batch 1: paused steps 80 ms, two draft steps 150 ms (taught twice),
    # then one two-step step takes 400 ms (a host hiccup, under the stall
    # filter's 4x). It is learnt as 1.5x its prediction at most.
    controller = GoodputController(max_num_reqs=1, num_speculative_tokens=2, free_pause=True)
    one = np.ones(1, dtype=np.int64)
    now, context = 0.0, 1000

    def step(draft_forwards, seconds):
        # The step verifies the drafts of the forwards before it.
        nonlocal now, context
        controller.observe(StepOutcome(draft_forwards=draft_forwards))
        now += seconds
        context += 1
        controller.plan(["r"], context * one, (1 + draft_forwards) * one, one, now)

    controller.plan(["r"], context * one, one, one, now)
    for index in range(60):
        drafts = index % 20 in (5, 6)
        step(2 if drafts else 0, 0.150 if drafts else 0.080)
    two_steps = step_features(3, 2, 2)
    before = float(controller.cost.predict(two_steps))
    assert before == pytest.approx(0.150, rel=0.05)
    step(2, 0.400)
    # Unclipped, this one step raised the prediction by 40% (12% now).
    assert float(controller.cost.predict(two_steps)) <= 1.15 * before


def test_a_catch_up_longer_than_any_timed_is_learnt_not_dropped_as_a_stall():
    # Catch-ups of 8 tokens cost 1 ms a token; one of 400 costs 10x its
    # prediction (a compute-bound draft forward). A stall of a kind seen
    # lately would be dropped; a catch-up that long was never timed: learnt.
    model = StepCostModel(max_draft_steps=K)
    for index in range(40):
        catch_up = 8 if index % 4 == 0 else 0
        model.observe_step(model.features(4, 1, catch_up), 0.1 + 0.02 + 0.001 * catch_up, 4.0, 1.5)
    assert model.most_catch_up_timed == 8
    long = model.features(4, 1, 400)
    predicted = float(model.predict(long))
    model.observe_step(long, 10 * predicted, 4.0, 1.5)
    assert model.most_catch_up_timed == 400
    assert float(model.predict(long)) > 3 * predicted


def test_a_long_pause_holds_the_forced_credit_to_one_probe_interval():
    # The account's credit is what one probe interval of paused plans earns:
    # a call does not spend the credit of the calls before it (#45: a
    # 48-token call's warm-up and probes spent 2.56 paused steps' credit).
    controller = GoodputController(max_num_reqs=4, num_speculative_tokens=K, free_pause=True)
    engine = SimulatedEngine(controller, {r: 0.0 for r in "abcd"})
    most = 0.0
    for _ in range(400):  # probes back off to 128 plans apart
        engine.step()
        most = max(most, controller.forced_account.balance)
    paused_step = 0.05 + 0.005 * 4
    assert controller.stats.probes > 0
    assert most == pytest.approx(0.02 * paused_step * controller.parameters.probe_interval,
                                 rel=0.05)


def test_drafting_stops_when_it_does_not_pay_for_anybody():
    controller = GoodputController(max_num_reqs=4, num_speculative_tokens=K, free_pause=True)
    # Drafts are never accepted and a draft step costs as much as the
    # target's: the target alone is faster.
    engine = SimulatedEngine(controller, {"a": 0.0, "b": 0.0}, draft_step=0.05)
    for _ in range(30):
        engine.step()
    steady = engine.history[8:]
    assert sum(h["a"] == 0 and h["b"] == 0 for h in steady) >= len(steady) - 2
    assert controller.stats.skipped_draft_forwards >= len(steady) - 2


def test_catch_up_puts_each_rows_gap_before_its_query():
    from vllm_specextend.control.catch_up import catch_up_layout

    # Row 0: query of 4 at positions 100-103, 2 tokens to catch up (98, 99);
    # row 1: nothing to catch up; row 2: query of 1 at 50, 3 to catch up.
    query_lens, starts, gaps = np.array([4, 1, 1]), np.array([98, 7, 47]), np.array([2, 0, 3])
    layout = catch_up_layout(query_lens, starts, gaps)
    assert layout.query_start_loc.tolist() == [0, 6, 7, 11]
    query_tokens = ["q0a", "q0b", "q0c", "q0d", "q1", "q2"]
    gap_tokens = [f"g{row}@{pos}" for row, pos in zip(layout.gap_rows, layout.gap_positions)]
    assert gap_tokens == ["g0@98", "g0@99", "g2@47", "g2@48", "g2@49"]
    flat = [(query_tokens + gap_tokens)[i] for i in layout.order]
    assert flat == ["g0@98", "g0@99", "q0a", "q0b", "q0c", "q0d", "q1",
                    "g2@47", "g2@48", "g2@49", "q2"]
    # Where each query token lands: its old index plus its row's shift.
    rows = np.repeat(np.arange(3), query_lens)
    landed = np.arange(len(query_tokens)) + layout.row_shift[rows]
    assert [flat[i] for i in landed] == query_tokens


def test_gap_slots_are_the_slots_vllm_maps_those_positions_to():
    import importlib

    from vllm_specextend.control.catch_up import gap_slot_mapping

    importlib.import_module("vllm._custom_ops")  # registers vLLM's CPU ops

    block_size = 4
    block_table = torch.tensor([[5, 2, 9, 7], [3, 11, 4, 0]], dtype=torch.int32)
    rows = torch.tensor([0] * 13 + [1] * 10)
    positions = torch.cat((torch.arange(13), torch.arange(2, 12)))
    # vLLM's CPU kernel for its own slot mapping (what the runner calls).
    vllm_slots = torch.full((len(positions),), -7, dtype=torch.int64)
    torch.ops._C.compute_slot_mapping_kernel_impl(
        torch.tensor([0, 13, 23], dtype=torch.int32), positions, block_table, vllm_slots,
        block_size)
    ours = gap_slot_mapping(block_table, rows, positions, block_size)
    assert ours.tolist() == vllm_slots.tolist()


def test_ring_rows_keep_each_requests_recent_positions_apart():
    from vllm_specextend.control.catch_up import ring_rows

    capacity = 8
    slots = np.array([0, 0, 1, 1, 1])
    positions = np.array([14, 15, 14, 15, 16])
    rows = ring_rows(slots, positions, capacity)
    assert rows.tolist() == [6, 7, 14, 15, 8]
    # ``capacity`` consecutive positions of one request never share a row.
    assert len(set(ring_rows(np.ones(capacity, int), np.arange(30, 30 + capacity),
                             capacity).tolist())) == capacity


def test_a_draft_cost_learnt_long_ago_is_not_forgotten_nor_its_step_dropped_as_a_stall():
    # Sure drafts, but a draft forward costs three paused steps (a 0.5B
    # draft against a 1.5B target at batch 8 on a CPU): drafting never pays.
    # After the warm-up the engine pauses for hundreds of steps; what the
    # warm-up taught must hold, and a drafting step must be learnt from even
    # when it costs many times what the model predicted.
    controller = GoodputController(max_num_reqs=8, num_speculative_tokens=K, free_pause=True)
    rows = {r: 1.0 for r in "abcdefgh"}
    engine = SimulatedEngine(controller, rows, draft_step=0.3)
    paused_step = 0.05 + 8 * 0.005
    for _ in range(50):
        engine.step()
    stats = controller.stats
    start, before = engine.now, (stats.drafted_request_steps, stats.probes, stats.explorations)
    steps = 1000
    for _ in range(steps):
        engine.step()
    overhead = (engine.now - start) / (steps * paused_step) - 1
    assert overhead <= 0.05  # 1.25 when the model forgot, dropping drafting steps as stalls
    # Every request-step that drafted was a probe or in an exploration.
    drafted, probes, explorations = (
        after - first for after, first in zip(
            (stats.drafted_request_steps, stats.probes, stats.explorations), before))
    assert drafted <= probes + explorations * len(rows)


def test_a_step_of_a_kind_not_seen_lately_is_learnt_from_not_dropped_as_a_stall():
    # A hundred paused steps of 0.09 s, then the first step with three draft
    # forwards, 1 s: many times the prediction, but a cost to learn (an
    # engine whose warm-up ran in prefills never saw one), not a stall.
    controller = GoodputController(max_num_reqs=8, num_speculative_tokens=K, free_pause=True)
    req_ids = list("abcdefgh")
    ones = np.ones(len(req_ids), dtype=np.int64)
    now = 0.0
    for step in range(100):
        controller.plan(req_ids, 1000 + step * ones, ones, ones, now)
        controller.observe(StepOutcome(draft_forwards=0))
        now += 0.09
    controller.observe(StepOutcome(draft_forwards=3))
    controller.plan(req_ids, 1100 * ones, ones, ones, now + 1.0)
    assert controller.cost.predict(step_features(8, 3, K)) > 0.5
    # A stall of a kind of step it knows is still dropped.
    controller.observe(StepOutcome(draft_forwards=0))
    before = controller.cost.weights.copy()
    controller.plan(req_ids, 1101 * ones, ones, ones, now + 3.0)
    assert np.array_equal(controller.cost.weights, before)


@pytest.mark.parametrize("draft_step, drafts_prompt", [(0.3, False), (0.001, True)])
def test_a_prompt_skips_the_draft_only_where_a_new_request_would_not_draft(draft_step,
                                                                          drafts_prompt):
    # Sure drafts; a draft forward costs three paused steps (never pays) or
    # a fiftieth of one (pays at full K).
    controller = GoodputController(max_num_reqs=8, num_speculative_tokens=K, free_pause=True)
    rows = {r: 1.0 for r in "abcd"}
    engine = SimulatedEngine(controller, rows, draft_step=draft_step)
    for _ in range(100):
        engine.step()
    # A new request's first prompt chunk beside them.
    req_ids = [*rows, "new"]
    context = np.array([engine.context[r] for r in rows] + [0])
    query = np.array([engine.query[r] for r in rows] + [256])
    plan = controller.plan(req_ids, context, query, np.array([1] * len(rows) + [1000]),
                           engine.now + 0.1)
    assert plan.draft_prefill is drafts_prompt
    # Alone (the others finished): the same.
    controller.observe(StepOutcome(draft_forwards=plan.draft_steps))
    controller.finish(list(rows))
    plan = controller.plan(["new"], np.array([256]), np.array([256]), np.array([1000]),
                           engine.now + 1.0)
    assert plan.draft_steps == 0 and plan.draft_prefill is drafts_prompt


def test_prompts_nobody_would_draft_for_reach_the_draft_within_the_prompt_budget():
    # Drafting never pays, so prompts skip the draft; but a few, within 2%
    # of the paused time, go through it: their requests can probe, and the
    # engine learns if drafting pays again.
    controller = GoodputController(max_num_reqs=8, num_speculative_tokens=K, free_pause=True)
    engine = SimulatedEngine(controller, {r: 1.0 for r in "abcd"}, draft_step=0.3,
                             catch_up=0.005)
    for _ in range(100):
        engine.step()
    through = []
    for arrival in range(40):
        for _ in range(50):
            engine.step()
        new = f"new{arrival}"
        req_ids = [*engine.acceptance, new]
        context = np.array([engine.context[r] for r in engine.acceptance] + [0])
        query = np.array([engine.query[r] for r in engine.acceptance] + [64])
        plan = controller.plan(req_ids, context, query, np.array([1] * 4 + [64]), engine.now)
        controller.observe(StepOutcome(draft_forwards=0))
        controller.finish([new])
        through.append(plan.draft_prefill)
    # A 64-token prompt costs 0.32 s of draft; 2% of 2,000 paused steps of
    # 0.07 s buys 9 of the 40.
    assert 2 <= sum(through) <= 10


def test_a_prompt_is_not_run_through_the_draft_for_a_number_of_draft_steps_never_timed():
    # Timed: paused steps (0.05 s + 5 ms a token) and K draft steps (1 s,
    # never pays). One or two draft steps were never run, so the model
    # prices them per draft step as K's (not as free, which would have the
    # choice try each once on the whole batch); untimed, they are still no
    # reason to pay a prompt's draft prefill.
    controller = GoodputController(max_num_reqs=8, num_speculative_tokens=K, free_pause=True)
    controller.warm_up.plans_done = len(WARM_UP)  # the steps below time what it would
    for step in range(20):
        tokens = 2 + step % 7
        controller.cost.observe(step_features(tokens, 0, K), 0.05 + 0.005 * tokens)
    for _ in range(3):
        controller.cost.observe(step_features(4 + 4 * K, K, K), 1.0)
    paused = controller.cost.predict(step_features(5, 0, K))
    per_draft_step = (controller.cost.predict(step_features(5, K, K)) - paused) / K
    for steps in range(1, K):
        assert controller.cost.predict(step_features(5, steps, K)) - paused == pytest.approx(
            steps * per_draft_step)
    plan = controller.plan(["new"], np.array([0]), np.array([64]), np.array([1000]), 0.0)
    assert plan.draft_steps == 0 and not plan.draft_prefill


def test_a_forced_draft_forward_is_shared_only_among_the_rows_that_run_it():
    # A draft forward runs for the whole batch whether one row drafts or
    # all do: a row forced alone pays all of it, two rows half each, a row
    # that drafts anyway takes its share. (As at a0b04fd's parent, a batch
    # share of it, 1/4 here, had a lone probe in a batch of 4 run a draft
    # forward worth four times its budget.)
    from vllm_specextend.control.plan_kernels import share_forwards

    def joined(margins, eligible, sharers=0):
        covered = np.zeros(len(margins), bool)
        count = share_forwards(np.array(margins), np.array(eligible), 0.4, sharers, covered)
        return count, covered.tolist()

    assert joined([0.3, 0.05, 0.0, 0.0], [True, True, False, False]) == (0, [False] * 4)
    assert joined([0.5, 0.05, 0.0, 0.0], [True, True, False, False]) == (
        1, [True, False, False, False])
    assert joined([0.3, 0.25, 0.0, 0.0], [True, True, False, False]) == (
        2, [True, True, False, False])
    assert joined([0.3, 0.05, 0.0, 0.0], [True, True, False, False], sharers=1) == (
        1, [True, False, False, False])


def test_a_row_still_in_its_prompt_shares_no_draft_forward():
    # A prompt prefilling in chunks gathers a pause budget too, but drafts
    # nothing: a lone decoding row that an exploration would force to draft
    # pays the whole forward, not half of it with the prompt's row.
    from vllm_specextend.control.cost_model import NUM_LINEAR_FEATURES
    from vllm_specextend.control.plan_kernels import affordable

    weights = np.zeros(NUM_LINEAR_FEATURES + K)
    weights[NUM_LINEAR_FEATURES] = 0.4  # one draft step's forward
    budgets, least = np.array([0.3, 1.0]), np.zeros(2)
    not_drafting = np.zeros(2, bool)

    def rows(decoding):
        return affordable(budgets, least, weights, 1, not_drafting, np.array(decoding), 0.0)

    assert rows([True, True]).tolist() == [True, True]  # 0.2 each
    assert rows([True, False]).tolist() == [False, False]  # 0.4 alone


def test_the_warm_up_does_not_catch_up_a_prompt_the_draft_lacks():
    # The input in float32: the prompts had skipped the draft, and the
    # warm-up's drafts at K on every row caught all of them up (2,410 tokens
    # of a 0.5B float32 draft on 2 cores: 0.37x the target alone).
    controller = GoodputController(max_num_reqs=2, num_speculative_tokens=K, free_pause=True)
    engine = SimulatedEngine(controller, {"deferred": 0.0, "in_sync": 0.0})
    engine.whole, engine.gap["deferred"] = {"deferred"}, 600
    for _ in range(4):
        engine.step()
    assert [h["in_sync"] for h in engine.history] == [K, K, 0, 0]  # the warm-up
    assert [h["deferred"] for h in engine.history] == [0, 0, 0, 0]
    assert engine.gap["deferred"] >= 600


def test_the_warm_up_waits_for_a_row_it_can_draft():
    # Every request's prompt skipped the draft: a warm-up plan that drafted
    # nothing would time nothing, and draft steps never timed look free
    # (a prompt would then go through the draft on that price, as in the
    # issue's 8 x 4K rounds). The warm-up waits for a request in sync.
    controller = GoodputController(max_num_reqs=2, num_speculative_tokens=K, free_pause=True)
    engine = SimulatedEngine(controller, {"deferred": 0.0})
    engine.whole, engine.gap["deferred"] = {"deferred"}, 600
    for _ in range(4):
        engine.step()
    assert [h["deferred"] for h in engine.history] == [0, 0, 0, 0]
    engine.acceptance["in_sync"], engine.query["in_sync"] = 0.0, 1
    engine.context["in_sync"] = engine.context["deferred"]
    for _ in range(5):
        engine.step()
    assert [h["in_sync"] for h in engine.history[4:]] == [K, K, 0, 0, 0]
    assert controller.cost.draft_steps_seen()[K]


def test_a_request_drafts_no_further_than_its_max_tokens():
    # A request whose drafts are all accepted drafts K, until its max_tokens
    # leaves less room: drafts count up to its last token at most, where
    # the room assumes none of this step's drafts is accepted.
    controller = GoodputController(max_num_reqs=2, num_speculative_tokens=K, free_pause=True)
    engine = SimulatedEngine(controller, {"r": 1.0})
    for _ in range(12):
        engine.step()
    assert engine.history[-1]["r"] == K  # unlimited so far
    slot = dict(controller.requests.items())["r"]
    prompt = 1  # the simulated engine's
    # The next plan: at least 2 more tokens (this query's and its sample),
    # then room for 2 drafts before the last of max_tokens.
    least_output = engine.context["r"] + 2 - prompt
    controller.state.max_output_tokens[slot] = least_output + 3
    assert engine.step().draft_lengths.tolist() == [2]
    # Then all of them were accepted: no room, no draft, no draft forward.
    plan = engine.step()
    assert plan.draft_lengths.tolist() == [0] and plan.draft_steps == 0


def test_no_probe_falls_on_a_paused_requests_last_step():
    # A paused request verifies no drafts, so its last step is known
    # exactly: a probe due then waits (its draft would never be verified).
    def simulated():
        controller = GoodputController(max_num_reqs=2, num_speculative_tokens=K,
                                       free_pause=True,
                                       parameters=ControlParameters(probe_interval=8))
        return controller, SimulatedEngine(controller, {"bad": 0.0})

    controller, engine = simulated()
    for _ in range(60):
        engine.step()
    probe_step = max(i for i, h in enumerate(engine.history) if i >= 10 and h["bad"])
    controller, engine = simulated()  # again, up to that probe
    for _ in range(probe_step):
        engine.step()
    slot = dict(controller.requests.items())["bad"]
    prompt = 1  # the simulated engine's
    controller.state.max_output_tokens[slot] = engine.context["bad"] + 2 - prompt
    probes = controller.stats.probes
    plan = engine.step()
    assert plan.draft_lengths.tolist() == [0] and plan.draft_steps == 0
    assert controller.stats.probes == probes
