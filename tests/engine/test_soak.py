"""The served soak (`python -m benchmarks --soak`) for 30 s on tiny models:
`vllm serve` with cmr and compact positions (a 512-position draft, prompts up
to 3,000 tokens) under a mixed load with dropped streams, prompts over
max_model_len, malformed JSON and invalid sampling parameters."""

from argparse import Namespace

import pytest

from benchmarks.corpus import CORPUS_DIR
from benchmarks.soak import BAD_KINDS, SOAK_MIX, run_soak, write_soak
from tests.tiny_models import TARGET_LLAMA, build_damped_attention_copy, build_short_window_copy

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    target = build_damped_attention_copy(TARGET_LLAMA, 0.05)
    draft = build_short_window_copy(target, 512)
    out = tmp_path_factory.mktemp("soak")
    args = Namespace(
        target=str(target), draft=str(draft), method="draft_model", k=3, dtype="float32",
        spec_extend='{"top_k_chunks": 2, "sink_tokens": 32, "recent_tokens": 256}',
        draft_window=512, kv_cache_gib=1, block_size=32, eager=True, concurrency=8,
        lengths=[1500, 3000], soak_minutes=0.5, soak_tokens=16, soak_replay_minutes=None,
        corpus=[CORPUS_DIR], out=out)
    result = run_soak(args)
    write_soak(result, out, "tiny models")
    return result, out


def test_only_the_bad_requests_fail_each_with_a_4xx(soak):
    result, _ = soak
    summary = result["summary"]
    assert all(summary["kinds"][kind]["sent"] > 0 for kind in SOAK_MIX)
    assert summary["good_requests_failed"] == 0
    assert summary["bad_requests_not_refused"] == 0
    assert all(summary["kinds"][kind]["refused_4xx"] > 0 for kind in BAD_KINDS)
    assert summary["kinds"]["disconnect"]["dropped_by_client"] > 0
    assert result["server_alive"] and result["server_log_errors"] == []
    assert result["final_metrics"]["vllm:spec_extend_retrievals_total"] > 0
    assert result["final_metrics"]["vllm:spec_extend_private_layout_areas"] == 8


def test_every_completed_request_equals_its_run_alone(soak):
    summary = soak[0]["summary"]
    assert summary["replayed"] == summary["distinct_completed"] >= 5
    assert summary["replays_equal"] == summary["replayed"]


def test_memory_and_kv_usage_are_recorded(soak):
    result, out = soak
    summary = result["summary"]
    assert len(result["samples"]) >= 4
    assert 0 < summary["kv_cache_usage_max"] <= 1
    # Flat after warm-up: no growth with the requests served.
    assert summary["rss_gib_max_after_warm_up"] <= 1.10 * summary["rss_gib_after_warm_up"]
    assert {p.name for p in out.iterdir()} >= {"soak.json", "soak.md", "soak.png"}
