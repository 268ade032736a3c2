"""Tensor parallelism: two ranks, each scoring with its own heads, all-reduce
the scores and must keep the same blocks; outputs equal the target alone."""

import pytest

from tests.engine_utils import (
    DRAFT_READS,
    SMALL_CACHE,
    assert_drafted_from_compacted_views,
    corpus_prompts,
    run_engine,
)

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("draft_window", [None, 1024], ids=["original", "compact"])
def test_cmr_with_two_tensor_parallel_ranks_equals_target_alone(
    target_model, draft_model, monkeypatch, draft_window, target_reference
):
    """Each rank's draft forwards are watched (``watch_draft_reads``): both
    read the same compacted block tables, step by step. Mutation: no
    all-reduce in ``sum_over_tensor_parallel_ranks`` (each rank keeps the
    chunks its own heads favour) fails the comparison."""
    # vLLM's automatic thread binding wants one NUMA node per CPU rank; bind
    # one core per rank by hand instead.
    prompts = corpus_prompts(target_model, [300, 2500, 4000])
    alone = target_reference(target_model, prompts, 32)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tp = run_engine(target_model, prompts, 32, draft=draft_model, spec_extend=SMALL_CACHE,
                    tensor_parallel_size=2, distributed_executor_backend="mp",
                    draft_window=draft_window, worker_hooks=DRAFT_READS)
    assert tp.token_ids == alone
    assert tp.retrieval["retrievals"] > 0
    assert tp.retrieval["kept_fraction"] < 0.5
    # Measured: 237 drafted, 15 accepted, 93 compacted draft forwards per rank
    # (original positions); 255, 8 and 129 (compact).
    assert_drafted_from_compacted_views(tp, 210, 6, 80)
    rank0, rank1 = tp.worker_reports
    assert rank0["tables"] == rank1["tables"]
