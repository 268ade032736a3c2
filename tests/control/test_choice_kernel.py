"""The compiled K choice (``control/choice_kernel.py``) equals numpy's
(``numpy_choice.py``) bit for bit, on random batches, costs and options."""

import numpy as np
import pytest

from tests.control.numpy_choice import fused_dot, numpy_choice
from vllm_specextend.control.choice_kernel import pairwise_sum
from vllm_specextend.control.cost_model import StepCostModel, fixed_seconds, step_seconds
from vllm_specextend.control.draft_lengths import choose_draft_lengths


def _bits(value: float) -> bytes:
    return np.float64(value).tobytes()


@pytest.mark.parametrize("n", [*range(0, 20), 127, 128, 129, 200, 250, 255, 256, 1000, 4099])
def test_pairwise_sum_is_numpys(n):
    rng = np.random.default_rng(n)
    values = rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)
    assert _bits(pairwise_sum(values, n)) == _bits(values.sum())
    zeros = np.full(n, -0.0)
    assert _bits(pairwise_sum(zeros, n)) == _bits(zeros.sum())


@pytest.mark.parametrize("k", [1, 3, 10, 12, 13])
@pytest.mark.parametrize("piecewise_step", [False, True])
def test_the_compiled_step_cost_is_the_fused_sum_of_its_features(k, piecewise_step):
    rng = np.random.default_rng(k)
    cost = StepCostModel(k, piecewise_step=piecewise_step)
    for _ in range(200):
        cost.weights = rng.standard_normal(len(cost.weights)) * 10.0 ** rng.integers(-6, 0)
        tokens, steps = int(rng.integers(0, 5000)), int(rng.integers(0, k + 2))
        catch_up, piecewise = int(rng.integers(0, 300)), bool(rng.random() < 0.5)
        features = cost.features(tokens, steps, catch_up, piecewise)
        seconds = cost.seconds(tokens, steps, catch_up, piecewise)
        assert _bits(seconds) == _bits(fused_dot(features, cost.weights))
        # numpy's dot (BLAS) sums in its own order: within rounding.
        assert seconds == pytest.approx(float(cost.predict(features)), rel=1e-12, abs=1e-15)
        free_pause = bool(rng.random() < 0.5)
        fixed = fixed_seconds(cost.weights, k, tokens, k, free_pause, piecewise_step and piecewise)
        for drafts in range(k + 1):
            forwards = drafts if (drafts or free_pause) else 1
            assert _bits(fixed[drafts]) == _bits(
                step_seconds(cost.weights, k, tokens, forwards, 0, piecewise_step and piecewise))


def _random_case(rng: np.random.Generator):
    k = int(rng.choice([1, 2, 3, 4, 7, 8, 9, 12]))
    rows = int(rng.choice([1, 2, 7, 8, 9, 33, 130, 257]))
    graphs = bool(rng.random() < 0.3)
    cost = StepCostModel(k, piecewise_step=graphs)
    for _ in range(int(rng.integers(0, 20))):
        features = cost.features(int(rng.integers(1, 600)), int(rng.integers(0, k + 1)),
                                 int(rng.integers(0, 50)) * int(rng.random() < 0.3),
                                 bool(rng.random() < 0.5))
        cost.observe(features, float(rng.uniform(0.01, 0.1)))
    rates = rng.uniform(0, 1, (rows, k)) ** rng.uniform(0.1, 3)
    rates[rng.random(rates.shape) < rng.choice([0.0, 0.2])] = 0.0
    rates[rng.random(rates.shape) < rng.choice([0.0, 0.3])] = 1.0
    options = {"other_tokens": int(rng.choice([0, 0, 100])),
               "free_pause": bool(rng.random() < 0.8),
               "hysteresis": float(rng.choice([0.0, 0.1, 0.3])),
               "pause_margin": float(rng.choice([0.0, 0.1]))}
    if rng.random() < 0.5:
        options["must_draft"] = rng.random(rows) < rng.choice([0.0, 0.05, 0.5])
    if rng.random() < 0.6:
        options["resume_seconds"] = np.where(rng.random(rows) < 0.5, 0.0,
                                             rng.uniform(0, 0.01, rows)) * rng.choice([0, 1])
    if rng.random() < 0.3:
        options["draft_steps"] = np.concatenate(([True], rng.random(k) < 0.5))
    if graphs or rng.random() < 0.2:
        options["uniform_draft_length"] = k
    num_requests = rows + int(rng.choice([0, 0, 3]))
    return np.cumprod(rates, axis=1), rng.random(rows) < 0.5, cost, num_requests, options


@pytest.mark.parametrize("seed", range(8))
def test_the_compiled_choice_is_numpys_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        survival, drafting, cost, num_requests, options = _random_case(rng)
        try:
            expected = numpy_choice(survival, drafting, cost, num_requests, **options)
        except AssertionError:  # probes, and no number of draft steps allowed
            with pytest.raises(AssertionError):
                choose_draft_lengths(survival, drafting, cost, num_requests, **options)
            continue
        plan = choose_draft_lengths(survival, drafting, cost, num_requests, **options)
        assert plan.draft_lengths.tolist() == expected.draft_lengths.tolist()
        assert plan.draft_steps == expected.draft_steps
        assert _bits(plan.expected_goodput) == _bits(expected.expected_goodput)
