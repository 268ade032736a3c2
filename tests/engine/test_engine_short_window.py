"""Engine tests: a draft whose window is shorter than the inputs (compact positions).

The draft has the target's weights but a 512-position window (its rotary table
ends there). The target's attention output is damped so that a draft seeing
only its working cache still predicts the next token often; random
full-strength attention spreads over the whole context and no partial view
predicts it. Stock vLLM switches drafting off for the whole batch as soon as
one request outgrows the draft's window; with compact positions every row
drafts, and outputs stay the target's.
"""

import pytest

from tests.engine_utils import (
    accepted_draft_tokens,
    assert_draft_positions_exact,
    collect_run,
    corpus_prompts,
    draft_positions,
    engine,
    run_engine,
    watch_draft_positions,
)
from tests.tiny_models import TARGET_LLAMA, build_damped_attention_copy, build_short_window_copy

pytestmark = pytest.mark.engine

MAX_TOKENS = 32
WINDOW = 512
# sink 32 + 2 chunks of 32 + recent 256 (+31) + 4 x 4 queries + 3 = 402 <= 512.
OPTIONS = {"top_k_chunks": 2, "sink_tokens": 32, "recent_tokens": 256, "min_context_tokens": 512}
LONG, SHORT = [0, 2], [1, 3]
LENGTHS = [2500, 350, 3800, 200]
DETAILED = {"per_request_spec_decode_metrics": "detailed"}


@pytest.fixture(scope="module")
def damped_target():
    return build_damped_attention_copy(TARGET_LLAMA, 0.05)


@pytest.fixture(scope="module")
def short_window_draft(damped_target):
    return build_short_window_copy(damped_target, WINDOW)


@pytest.fixture(scope="module")
def prompts(damped_target):
    return corpus_prompts(damped_target, LENGTHS)


@pytest.fixture(scope="module")
def target_alone(target_reference, damped_target, prompts):
    return target_reference(damped_target, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def compact_runs(damped_target, short_window_draft, prompts, document_questions):
    """The mixed batch, then its short rows alone, then questions on one
    cached document, in one compact-position engine (prefix caching on, as
    vLLM's default: private layouts); and the draft's positions, checked at
    every forward (``watch_draft_positions``)."""
    with engine(damped_target, short_window_draft, spec_extend=OPTIONS, **DETAILED) as llm:
        llm.collective_rpc(watch_draft_positions)
        mixed = collect_run(llm, prompts, MAX_TOKENS)
        short_only = collect_run(llm, [prompts[r] for r in SHORT], MAX_TOKENS)
        questions = ask_about_one_document(llm, document_questions)
        positions = llm.collective_rpc(draft_positions)[0]
    return mixed, short_only, questions, positions


@pytest.fixture(scope="module")
def document_questions(damped_target):
    """One 2,500-token document (5x the draft's window) and four questions
    of different lengths after it (so the shared document blocks sit at
    different compact positions in each request)."""
    document, *questions = corpus_prompts(damped_target, [2500, 20, 90, 170, 260])
    return document, [document + q for q in questions]


def ask_about_one_document(llm, document_questions):
    """A first request caches the document; then all questions at once."""
    document, prompts = document_questions
    collect_run(llm, [document + prompts[0][len(document):][:10]], 4)
    return collect_run(llm, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def compact(compact_runs):
    return compact_runs[0]


def acceptance_rate(run, rows):
    metrics = [run.request_spec_decode[r] for r in rows]
    return (sum(accepted_draft_tokens(m) for m in metrics)
            / sum(m.num_draft_tokens for m in metrics))


def test_mixed_batch_drafts_on_every_row_and_equals_target_alone(compact, target_alone):
    assert compact.token_ids == target_alone
    for metrics in compact.request_spec_decode:
        assert metrics.num_draft_tokens > 0
    # Measured: 0.42 on the long rows (draft = target weights, ~11% of the
    # context kept); the short rows draft with their whole context.
    assert acceptance_rate(compact, LONG) > 0.3
    assert acceptance_rate(compact, SHORT) > 0.9
    assert compact.retrieval["compacted_request_steps"] > 0
    assert compact.retrieval["kept_fraction"] < 0.2


@pytest.fixture(scope="module")
def stock(damped_target, short_window_draft, prompts):
    return run_engine(damped_target, prompts, MAX_TOKENS, draft=short_window_draft, **DETAILED)


def test_stock_vllm_switches_drafting_off_for_the_whole_batch(stock, target_alone):
    assert stock.token_ids == target_alone
    # Measured: 0 of 186 draft tokens accepted (they are all token id 0).
    assert acceptance_rate(stock, LONG) < 0.02
    assert stock.spec_decode["num_accepted_tokens"] < 0.05 * stock.spec_decode["num_draft_tokens"]


def test_every_draft_step_runs_at_original_minus_removed_positions(compact_runs):
    """Mutations that fail it: V1 ``_get_positions`` one position off for
    compacted rows; later draft steps left at the first pass's per-token
    shifts, or unshifted."""
    # Measured: 183 compacted forwards, 122 of them later draft steps.
    assert_draft_positions_exact(compact_runs[3], min_later_steps=100)


def test_short_rows_accept_as_in_a_batch_of_short_rows_only(compact_runs):
    compact, short_only, _, _ = compact_runs
    mixed = [accepted_draft_tokens(compact.request_spec_decode[r]) for r in SHORT]
    alone = [accepted_draft_tokens(m) for m in short_only.request_spec_decode]
    assert mixed == alone
    assert short_only.token_ids == [compact.token_ids[r] for r in SHORT]


def test_plain_draft_kv_copy_is_counted_in_the_kv_cache_budget(compact, stock):
    # Target and draft have the same shape (4 layers). Per token, in one
    # layer's keys: the cache holds 2 models x 4 layers x K and V = 16, the
    # plain draft copy 8 more, the tap 1: the same budget holds 16/25 of the
    # blocks. Of those, 8 requests x 512 / 32 blocks are private layouts.
    private_layout_blocks = 8 * WINDOW // 32
    assert compact.num_kv_blocks + private_layout_blocks == pytest.approx(
        stock.num_kv_blocks * 16 / 25, rel=0.01)


def test_questions_on_one_cached_document_draft_over_their_own_layouts(
    compact_runs, damped_target, short_window_draft, document_questions, target_reference
):
    # With prefix caching the four requests share the document's blocks,
    # each at its own compact positions (questions of different lengths).
    # Each lays its draft working cache out in its private area
    # (tests/retrieval/test_private_layouts.py shows what in place does), so
    # it keeps the acceptance of the same batch without prefix caching, where
    # nothing is shared; outputs are the target's.
    _, prompts = document_questions
    private = compact_runs[2]
    with engine(damped_target, short_window_draft, enable_prefix_caching=False,
                spec_extend=OPTIONS, **DETAILED) as llm:
        unshared = collect_run(llm, prompts, MAX_TOKENS)
    assert private.token_ids == unshared.token_ids == target_reference(
        damped_target, prompts, MAX_TOKENS)
    for row in range(len(prompts)):
        assert acceptance_rate(private, [row]) >= 0.95 * acceptance_rate(unshared, [row])
    assert private.retrieval["private_layout_areas"] == 8
    assert private.retrieval["layouts_in_place"] == 0
    assert unshared.retrieval["private_layout_areas"] == 0
