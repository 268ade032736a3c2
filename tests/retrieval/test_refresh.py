"""Retrieval refresh: on a fixed interval, or when a request's acceptance
under its current selection drops (host lengths only; no engine)."""

import pytest

from tests.retrieval.test_planner import K, planning_batch, streaming_planner
from vllm_specextend.common.options import SpecExtendConfig, SpecExtendConfigError
from vllm_specextend.retrieval.refresh import AcceptanceTrend


def run_request(planner, accepted_per_step, context=3000):
    """One request verifying K drafts per step that accepts
    ``accepted_per_step[i]`` of them at step i; returns the causes of the
    retrievals per step (None: none)."""
    causes = []
    for accepted in accepted_per_step:
        before = dict(planner.stats.refreshes)
        planner.plan(planning_batch(["a"], [K + 1], [context], [1000]))
        after = planner.stats.refreshes
        causes.append(next((c for c in after if after[c] > before[c]), None))
        context += accepted + 1
    return causes


def test_acceptance_trend_reads_the_lengths_and_waits_for_the_selection():
    trend = AcceptanceTrend()
    trend.observe(3000, K + 1, steps_since_retrieval=0)
    trend.observe(3000 + K + 1, K + 1, steps_since_retrieval=1)  # all accepted
    assert trend.level == 1.0 and trend.observations == 0  # older selection's drafts
    trend.observe(3000 + K + 2, K + 1, steps_since_retrieval=2)  # none accepted
    trend.observe(3000 + K + 3, K + 1, steps_since_retrieval=3)
    assert trend.observations == 2 and trend.recent == 0.0
    assert trend.level == pytest.approx(0.75 * 0.75)
    assert trend.dropped(0.5)
    trend.new_selection("acceptance")
    assert not trend.dropped(0.5)
    assert trend.level == 0.0  # the level the refresh starts from
    # A step after one without drafts (query of 1), or a jump, says nothing.
    trend.observe(3000 + K + 4, 1, steps_since_retrieval=2)
    trend.observe(3000 + K + 5, K + 1, steps_since_retrieval=3)
    trend.observe(5000, K + 1, steps_since_retrieval=4)
    assert trend.observations == 1


def test_a_steady_request_retrieves_on_the_interval_only():
    planner = streaming_planner(retrieval_refresh="acceptance", retrieval_interval=8)
    causes = run_request(planner, [2] * 20)
    assert causes[0] == "first"
    assert [i for i, c in enumerate(causes) if c] == [0, 8, 16]
    assert planner.stats.refreshes == {"first": 1, "interval": 2, "acceptance": 0}


def test_a_drop_in_acceptance_retrieves_before_the_interval():
    accepted = [K] * 6 + [0] * 24
    fixed = run_request(streaming_planner(retrieval_interval=16), accepted)
    assert [i for i, c in enumerate(fixed) if c] == [0, 16]
    planner = streaming_planner(retrieval_refresh="acceptance", retrieval_interval=16)
    causes = run_request(planner, accepted)
    # Step 6 verifies the first rejected drafts; its lengths show at step 7,
    # and two observations of them at step 8. The new selection does no
    # better and falls from the old one's 0.25 to 0: one more refresh, then
    # none until the interval (refreshing cannot help a request whose
    # acceptance stays at its level).
    assert [(i, c) for i, c in enumerate(causes) if c] == [
        (0, "first"), (8, "acceptance"), (11, "acceptance"), (27, "interval")]
    assert planner.metrics_snapshot()["requests"]["a"]["refreshes"] == {"first": 1, "interval": 1, "acceptance": 2}
    # Per-request figures carry the causes.
    assert planner.metrics_snapshot()["requests"]["a"]["refreshes"]["acceptance"] == 2


def test_refresh_options_are_checked():
    with pytest.raises(SpecExtendConfigError, match="retrieval_refresh"):
        SpecExtendConfig(retrieval_refresh="sometimes")
    for bad in (0, 1, 1.5, True, "half"):
        with pytest.raises(SpecExtendConfigError, match="acceptance_drop"):
            SpecExtendConfig(acceptance_drop=bad)
