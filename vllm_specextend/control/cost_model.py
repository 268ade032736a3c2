"""The step-cost model: seconds per engine step, learnt online on this engine.

A linear function of what the step verifies and drafts (:func:`cost_features`),
fitted by exponentially weighted ridge regression (:class:`StepCostModel`).
On the host: numpy, and the per-step predictions compiled with numba
(:func:`step_seconds`, :func:`fixed_seconds`); independent of vLLM.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from vllm_specextend.common.compiled import compiled
from vllm_specextend.common.kernel_args import floats
from vllm_specextend.control.kernel_state import CostFit, FitSettings, StepCosts


def cost_features(max_draft_steps: int, piecewise_step: bool = False) -> tuple[str, ...]:
    """What one engine step costs, linearly: a base (the batch's target
    forward, which grows with its context and requests; the exponential
    forgetting tracks it), each token verified beyond it, each token the
    draft catches up after a pause, and the draft phase as one cost per
    number of draft steps ``D`` (one-hot). A table rather
    than a cost per forward: on CPUs the target's step is not linear in its
    tokens at small batch (measured on the Qwen pair, bf16: verifying 2
    tokens cost 0.154 s, 3 tokens 0.113 s, 1 token 0.121 s), and at batch 1
    the tokens and ``D`` move together, so only a cost per ``D`` can tell
    which ``D`` pays.

    With ``piecewise_step`` (the target runs FULL CUDA graphs): one more, a
    step whose target forward left them. Under vLLM's FULL decode graphs a
    batch is a graph's only when every request verifies ``1 + K`` tokens
    (``GPUModelRunner._is_uniform_decode``); a step with fewer drafts for
    some request, or none, runs PIECEWISE."""
    return ("step", "verified_tokens", "catch_up_tokens") + tuple(
        f"draft_steps_{d}" for d in range(1, max_draft_steps + 1)) + (
        ("piecewise_step",) if piecewise_step else ())


NUM_LINEAR_FEATURES = 3
"""The features before the one-hot draft steps (clipped at zero when fitted)."""


def step_features(verified_tokens: int, draft_steps: int, max_draft_steps: int,
                  catch_up_tokens: int = 0, piecewise: bool | None = None) -> np.ndarray:
    """The cost features of one step (see :func:`cost_features`); ``piecewise``
    only for a model with the ``piecewise_step`` feature (None: without)."""
    features = np.zeros(NUM_LINEAR_FEATURES + max_draft_steps + (piecewise is not None),
                        dtype=np.float64)
    features[:NUM_LINEAR_FEATURES] = 1.0, verified_tokens, catch_up_tokens
    if draft_steps:
        features[NUM_LINEAR_FEATURES - 1 + min(draft_steps, max_draft_steps)] = 1.0
    if piecewise is not None:
        features[-1] = float(piecewise)
    return features


@intrinsic
def _fused_multiply_add(typingctx, a, b, c):
    """``a * b + c`` rounded once (LLVM's ``fma``), as OpenBLAS's dot product
    adds each term on FMA hardware."""
    signature = types.float64(types.float64, types.float64, types.float64)

    def codegen(context, builder, sig, args):
        double = ir.DoubleType()
        fma = builder.module.declare_intrinsic("llvm.fma", [double],
                                               ir.FunctionType(double, [double] * 3))
        return builder.call(fma, args)

    return signature, codegen


@compiled
def step_seconds(weights, max_draft_steps, verified_tokens, draft_steps, catch_up_tokens,
                 piecewise):
    """``step_features(...) @ weights`` without building the features, summed
    left to right with one fused multiply-add per feature: the sum numpy's
    dot makes through OpenBLAS on FMA hardware below 16 features (K up to
    12), so there a prediction is bit for bit :meth:`StepCostModel.predict`'s
    (elsewhere within rounding)."""
    draft_column = (NUM_LINEAR_FEATURES - 1 + min(draft_steps, max_draft_steps)
                    if draft_steps else -1)
    total = 0.0
    for column in range(weights.shape[0]):
        if column < NUM_LINEAR_FEATURES:
            feature = (1.0, float(verified_tokens), float(catch_up_tokens))[column]
        elif column < NUM_LINEAR_FEATURES + max_draft_steps:
            feature = 1.0 if column == draft_column else 0.0
        else:
            feature = 1.0 if piecewise else 0.0
        total = _fused_multiply_add(feature, weights[column], total)
    return total


@compiled
def fixed_seconds(weights, max_draft_steps, base_tokens, max_k, free_pause, piecewise):
    """``[max_k + 1]``: per number of draft steps ``D``, the predicted
    seconds of a step of ``base_tokens`` before its drafts' tokens
    (``free_pause``: no draft forward at ``D = 0``, else one)."""
    fixed = np.empty(max_k + 1)
    for steps in range(max_k + 1):
        forwards = steps if (steps or free_pause) else 1
        fixed[steps] = step_seconds(weights, max_draft_steps, base_tokens, forwards, 0,
                                    piecewise)
    return fixed


@compiled
def fit_step(fit, weights, features, seconds, settings):
    """One step of the exponentially weighted ridge regression: ``fit``'s
    sums (a ``CostFit``) updated in place (the sums numpy made: each entry
    ``forgetting * old + new``), the new weights returned. The ridge
    scales with the data so it stays a tie-breaker; it pulls towards the
    current ``weights``: a cost the recent steps no longer show (a number of
    draft steps not run for hundreds of paused steps) keeps what was learnt,
    instead of decaying to free. The base and per-token costs are clipped at
    zero, and with ``piecewise_step`` the last one (``settings``: a
    ``FitSettings``)."""
    gram, moment, seen = fit.gram, fit.moment, fit.seen
    forgetting, piecewise_step = settings.forgetting, settings.piecewise_step
    num = features.shape[0]
    trace = 0.0
    for i in range(num):
        for j in range(num):
            gram[i, j] = forgetting * gram[i, j] + features[i] * features[j]
        moment[i] = forgetting * moment[i] + features[i] * seconds
        seen[i] |= features[i] != 0
        trace += gram[i, i]
    scaled = settings.ridge * (1.0 if 1.0 > trace else trace)  # Python's max(trace, 1.0)
    system = gram.copy()
    rhs = np.empty(num)
    for i in range(num):
        system[i, i] += scaled
        rhs[i] = moment[i] + scaled * weights[i]
    solution = _solve_small(system, rhs)
    for i in range(min(NUM_LINEAR_FEATURES, num)):
        if solution[i] < 0.0:
            solution[i] = 0.0
    if piecewise_step and solution[num - 1] < 0.0:
        solution[num - 1] = 0.0
    _price_untimed_draft_steps(solution, seen,
                               num - NUM_LINEAR_FEATURES - (1 if piecewise_step else 0))
    return solution


@compiled
def _price_untimed_draft_steps(weights, seen, max_draft_steps):
    """A number of draft steps no step has shown yet costs, per draft step,
    what the most draft steps timed cost per step (draft forwards cost
    about alike), not nothing: otherwise the controller would try every
    untimed ``D`` on the whole batch once, whatever a draft forward costs.
    Nothing timed yet: left as it is (the warm-up times ``K`` first)."""
    most = 0
    for steps in range(max_draft_steps, 0, -1):
        if seen[NUM_LINEAR_FEATURES + steps - 1]:
            most = steps
            break
    if most == 0:
        return
    per_step = weights[NUM_LINEAR_FEATURES + most - 1] / most
    for steps in range(1, max_draft_steps + 1):
        if not seen[NUM_LINEAR_FEATURES + steps - 1]:
            weights[NUM_LINEAR_FEATURES + steps - 1] = per_step * steps


@compiled
def _solve_small(system, rhs):
    """``system @ x = rhs`` for a few unknowns, by Gaussian elimination with
    partial pivoting (as LAPACK's ``gesv``; overwrites both)."""
    num = rhs.shape[0]
    for k in range(num):
        pivot = k
        for i in range(k + 1, num):
            if abs(system[i, k]) > abs(system[pivot, k]):
                pivot = i
        if system[pivot, k] == 0.0:
            raise ValueError("the step-cost system is singular")
        if pivot != k:
            for j in range(num):
                system[k, j], system[pivot, j] = system[pivot, j], system[k, j]
            rhs[k], rhs[pivot] = rhs[pivot], rhs[k]
        for i in range(k + 1, num):
            factor = system[i, k] / system[k, k]
            for j in range(k + 1, num):
                system[i, j] -= factor * system[k, j]
            rhs[i] -= factor * rhs[k]
    solution = np.empty(num)
    for i in range(num - 1, -1, -1):
        total = rhs[i]
        for j in range(i + 1, num):
            total -= system[i, j] * solution[j]
        solution[i] = total / system[i, i]
    return solution


@compiled
def catch_up_prices(weights, timed):
    """Seconds per caught-up token, and per token of a forced draft's
    catch-up (see :meth:`StepCostModel.catch_up_seconds` and
    :meth:`StepCostModel.forced_catch_up_seconds`; ``timed``: a step with
    caught-up tokens was timed). Once timed, both are the learnt price:
    not held to a verified token's, which a memory-bound target's decode
    can learn as free while the draft's catch-up is compute-bound (issue
    #45's Zen 4: probes then bought 212-252 tokens, a second each)."""
    verified = weights[1]
    if not timed:
        return verified, 0.0
    return weights[2], weights[2]


class StepCostModel:
    """Seconds per engine step, ``features . weights``, learnt online.

    Exponentially weighted ridge regression (recent steps count more; the
    ridge term keeps unidentified weights where they are until the data
    tells them apart: a number of draft steps never seen is priced per draft
    step as the most draft steps seen, so the controller tries it when
    acceptance says it would pay at that price, and learns). The base and the
    per-token costs are clipped at zero; the cost of ``D`` draft steps is
    not, since it corrects the per-token cost at small batch, where the two
    move together (a 3-token step can cost less than a 2-token one).
    """

    def __init__(self, max_draft_steps: int, forgetting: float = 0.98,
                 ridge: float = 1e-6, piecewise_step: bool = False) -> None:
        self.max_draft_steps = max_draft_steps
        self.piecewise_step = piecewise_step
        """Whether steps that leave FULL CUDA graphs carry a cost of their own."""
        num = len(cost_features(max_draft_steps, piecewise_step))
        self.forgetting = forgetting
        self.ridge = ridge
        self._gram = np.zeros((num, num))
        self._moment = np.zeros(num)
        self.weights = np.zeros(num)
        self.observations = 0
        self.seen = np.zeros(num, dtype=bool)
        """Features some observed step had."""
        self.most_catch_up_timed = 0
        """The most tokens a learnt step caught up: the price of a catch-up
        holds for catch-ups about that long (a longer one can cost far more
        per token: a CPU draft's forward turns compute-bound)."""

    def observe(self, features: np.ndarray, seconds: float) -> None:
        """Learn one step's cost (compiled, :func:`fit_step`)."""
        self.weights = fit_step(CostFit(self._gram, self._moment, self.seen), self.weights,
                                np.ascontiguousarray(features, dtype=np.float64), float(seconds),
                                FitSettings(float(self.forgetting), float(self.ridge),
                                            bool(self.piecewise_step)))
        self.observations += 1

    def observe_step(self, features: np.ndarray, seconds: float, stall_factor: float,
                     slow_step_clip: float) -> None:
        """Learn an engine step's cost, robustly: a step of a kind seen lately
        that took ``stall_factor`` times its prediction is a stall (an idle
        engine), skipped; a slower one is learnt as ``slow_step_clip`` times
        its prediction at most. (A step of a kind not seen lately, a catch-up
        or a number of draft steps, or a catch-up longer than any timed, shows
        a cost the model has yet to learn.)"""
        catch_up = int(features[NUM_LINEAR_FEATURES - 1])
        if (self.observations >= 8 and self.knows(features)
                and catch_up <= self.most_catch_up_timed):
            predicted = float(self.predict(features))
            if predicted > 0:
                if seconds > stall_factor * predicted:
                    return
                # One slow step (a request's first retrieval, the host's
                # hiccup) moves the model as far as a 1.5x one: otherwise
                # it can price a number of draft steps out for a whole run.
                seconds = min(seconds, slow_step_clip * predicted)
        self.observe(features, seconds)
        self.most_catch_up_timed = max(self.most_catch_up_timed, catch_up)

    @property
    def catch_up_timed(self) -> bool:
        """Whether a step with caught-up tokens was timed (until then a
        caught-up token is priced as a verified one)."""
        return self.most_catch_up_timed > 0

    def catch_up_seconds(self) -> float:
        """Seconds per caught-up token: learnt once a catch-up was timed;
        before, a verified token's, so resumptions and prompts are not
        priced as free."""
        return float(catch_up_prices(self.weights, self.catch_up_timed)[0])

    def forced_catch_up_seconds(self) -> float:
        """Seconds per token a forced draft's catch-up is priced at: none
        until a catch-up was timed, since the engine's first forced drafts
        catch up only ``min_probe_catch_up`` tokens, which times the price.
        (A verified token's price overstates it where the steps cannot tell
        the base from a token: at batch 1, half of a paused step.)"""
        return float(catch_up_prices(self.weights, self.catch_up_timed)[1])

    def kernel_args(self) -> StepCosts:
        """What a compiled loop prices a step with."""
        return StepCosts(floats(self.weights), int(self.max_draft_steps), bool(self.piecewise_step),
                         int(self.most_catch_up_timed))

    def knows(self, features: np.ndarray) -> bool:
        """Whether recent steps showed every feature ``features`` has (about
        one step's weight at least since forgetting)."""
        return all(weight >= 1.0 for weight, feature in zip(np.diag(self._gram).tolist(),
                                                            features.tolist()) if feature)

    def predict(self, features: np.ndarray) -> np.ndarray | float:
        return features @ self.weights

    def seconds(self, verified_tokens: int, draft_steps: int = 0, catch_up_tokens: int = 0,
                piecewise: bool = False) -> float:
        """The predicted seconds of one step:
        ``predict(features(verified_tokens, draft_steps, catch_up_tokens, piecewise))``,
        compiled (:func:`step_seconds`)."""
        return step_seconds(self.weights, self.max_draft_steps, verified_tokens, draft_steps,
                            catch_up_tokens, piecewise and self.piecewise_step)

    def draft_steps_seen(self) -> np.ndarray:
        """``[K + 1]`` bool: the numbers of draft steps some observed step
        ran (0: always)."""
        return np.concatenate(([True], self.seen[NUM_LINEAR_FEATURES:][:self.max_draft_steps]))

    @property
    def piecewise_cost(self) -> float:
        """Seconds a step pays for leaving the FULL CUDA graphs (0 without them)."""
        return float(self.weights[-1]) if self.piecewise_step else 0.0

    def features(self, verified_tokens: int, draft_steps: int, catch_up_tokens: int = 0,
                 piecewise: bool = False) -> np.ndarray:
        """:func:`step_features` in this model's layout."""
        return step_features(verified_tokens, draft_steps, self.max_draft_steps,
                             catch_up_tokens, piecewise if self.piecewise_step else None)
