"""Retrieval figures: device-side accounting and their Prometheus rendering
(no engine; the engine paths are covered in test_engine_* and test_serve)."""

import re

import numpy as np
import pytest
import torch

from vllm_specextend.metrics import SpecExtendCollector
from vllm_specextend.retrieval.counters import FINISHED_ROWS, RetrievalStats

NO_PRIVATE_LAYOUTS = {"private_layout_areas": 0, "layouts_in_place": 0}


def stats_after_two_requests() -> RetrievalStats:
    stats = RetrievalStats(max_num_reqs=4, device=torch.device("cpu"))
    # Slot 1: two steps at 1,000 tokens keeping 250, accepting 3 then 2 tokens.
    # Slot 2: one step at 4,000 tokens keeping 400, first step (nothing verified).
    stats.record_step(torch.tensor([1, 2]), torch.tensor([1000, 4000]),
                      removed_tokens=torch.tensor([750, 3600]),
                      acceptance_lengths=torch.tensor([3, 0]))
    stats.record_step(torch.tensor([1]), torch.tensor([1001]),
                      removed_tokens=torch.tensor([751]),
                      acceptance_lengths=torch.tensor([2]))
    stats.refreshes.update(first=2, acceptance=1)  # 3 retrievals
    return stats


def test_per_request_figures_and_histograms():
    stats = stats_after_two_requests()
    assert stats.request_figures(1) == pytest.approx(
        {"kept_fraction": 500 / 2001, "mean_acceptance_length": 2.5, "verifications": 2})
    assert stats.request_figures(2)["kept_fraction"] == pytest.approx(0.1)
    stats.finish_request(1)
    stats.finish_request(2)
    totals = stats.as_dict()
    assert totals["context_tokens"] == 6001 and totals["kept_tokens"] == 900
    assert totals["mean_acceptance_length"] == pytest.approx(2.5)
    assert totals["finished_requests"] == 2
    kept = stats.request_kept_fraction.as_dict()
    # 0.1 falls in the le=0.1 bucket, 0.2499 in le=0.25; both counted once.
    assert kept["cumulative_counts"][:5] == [0, 1, 1, 1, 2]
    assert kept["count"] == 2 and kept["sum"] == pytest.approx(0.1 + 500 / 2001)
    # Slot 2 never verified a draft: no acceptance observation for it.
    assert stats.request_acceptance_length.as_dict()["count"] == 1
    # Freed slots start from zero for the next request.
    assert stats.request_figures(1)["verifications"] == 0


def test_collector_renders_counters_gauges_and_histograms():
    from prometheus_client import CollectorRegistry, generate_latest

    stats = stats_after_two_requests()
    stats.finish_request(1)
    snapshot = {**stats.as_dict(), "tracked_requests": 1, **NO_PRIVATE_LAYOUTS,
                "request_kept_fraction": stats.request_kept_fraction.as_dict(),
                "request_acceptance_length": stats.request_acceptance_length.as_dict()}
    registry = CollectorRegistry()
    collector = SpecExtendCollector()
    registry.register(collector)
    assert generate_latest(registry) == b""  # nothing before the first pull
    collector.update("tiny", snapshot)
    text = generate_latest(registry).decode()
    assert 'vllm:spec_extend_retrievals_total{model_name="tiny"} 3.0' in text
    assert 'vllm:spec_extend_kept_tokens_total{model_name="tiny"} 900.0' in text
    assert 'vllm:spec_extend_refreshes_total{cause="acceptance",model_name="tiny"} 1.0' in text
    assert 'vllm:spec_extend_refreshes_total{cause="interval",model_name="tiny"} 0.0' in text
    assert 'vllm:spec_extend_tracked_requests{model_name="tiny"} 1.0' in text
    assert 'vllm:spec_extend_request_kept_fraction_bucket{le="0.25",model_name="tiny"} 1.0' in text
    assert 'vllm:spec_extend_request_kept_fraction_count{model_name="tiny"} 1.0' in text


def test_figures_start_afresh_with_each_engine():
    """A new engine's Prometheus logger runs vLLM's unregister_vllm_metrics();
    the figures of an earlier engine in the process must not outlive it."""
    from types import SimpleNamespace

    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.metrics.reader import get_metrics_snapshot

    from vllm_specextend import metrics

    def published_retrievals() -> list[float]:
        return [m.value for m in get_metrics_snapshot()
                if m.name == "vllm:spec_extend_retrievals"]

    unregister_vllm_metrics()  # earlier tests' engines may have published
    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name="tiny"))
    stats = stats_after_two_requests()
    snapshot = {**stats.as_dict(), "tracked_requests": 0, **NO_PRIVATE_LAYOUTS,
                "request_kept_fraction": stats.request_kept_fraction.as_dict(),
                "request_acceptance_length": stats.request_acceptance_length.as_dict()}
    metrics.publish(config, [snapshot])
    assert published_retrievals() == [3]
    unregister_vllm_metrics()  # what the next engine's stat logger does
    assert published_retrievals() == []
    metrics.publish(config, [{**snapshot, "retrievals": 1}])
    assert published_retrievals() == [1]
    unregister_vllm_metrics()


def test_goodput_control_figures_per_request_and_in_prometheus():
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_specextend.control.speculation_control import SpeculationControl

    control = SpeculationControl(max_num_reqs=4, num_speculative_tokens=2, free_pause=True)
    prompt = np.array([100, 100])
    context = np.array([100, 100])
    for _ in range(6):  # warm-up: 2 steps at K, then 2 paused, then the controller's choice
        control.plan_step(["a", "b"], context, np.array([1, 1]), prompt)
        context = context + 1
    requests = control.metrics_snapshot()["requests"]
    assert requests["a"]["drafted_steps"] >= 2  # the warm-up drafts
    assert requests["a"]["drafted_steps"] + requests["a"]["paused_steps"] == 6
    control.plan_step(["b"], context[1:], np.array([1]), prompt[1:])  # "a" finished
    snapshot = control.metrics_snapshot()
    paused = snapshot["request_paused_fraction"]
    assert paused["count"] == 1
    assert paused["sum"] == pytest.approx(requests["a"]["paused_steps"] / 6)
    assert list(snapshot["requests"]) == ["b"]
    registry = CollectorRegistry()
    collector = SpecExtendCollector()
    registry.register(collector)
    stats = stats_after_two_requests()
    collector.update("tiny", {**stats.as_dict(), "tracked_requests": 1, **NO_PRIVATE_LAYOUTS,
                              "request_kept_fraction": stats.request_kept_fraction.as_dict(),
                              "request_acceptance_length":
                                  stats.request_acceptance_length.as_dict(),
                              "control": snapshot})
    text = generate_latest(registry).decode()
    assert ('vllm:spec_extend_control_request_paused_fraction_count{model_name="tiny"} 1.0'
            in text)
    assert 'vllm:spec_extend_control_chosen_draft_length_total{draft_length="2",' in text
    # Warm-up plans are not explorations, nor charged as forced drafts unpriced.
    assert 'vllm:spec_extend_control_explorations_total{model_name="tiny"} 0.0' in text
    assert 'vllm:spec_extend_control_forced_draft_seconds_total{model_name="tiny"} 0.0' in text
    assert 'vllm:spec_extend_control_warm_up_pending{model_name="tiny"} 0.0' in text
    # Its own planning, timed on the host and charged to the probe budget.
    host = re.search(r'spec_extend_control_host_seconds_total\{model_name="tiny"\} (\S+)', text)
    assert float(host.group(1)) == pytest.approx(snapshot["host_seconds"]) and snapshot[
        "host_seconds"] > 0
    fresh = SpeculationControl(max_num_reqs=4, num_speculative_tokens=2, free_pause=True)
    collector.update("tiny", {**stats.as_dict(), "tracked_requests": 1, **NO_PRIVATE_LAYOUTS,
                              "request_kept_fraction": stats.request_kept_fraction.as_dict(),
                              "request_acceptance_length":
                                  stats.request_acceptance_length.as_dict(),
                              "control": fresh.metrics_snapshot()})
    text = generate_latest(registry).decode()
    assert 'vllm:spec_extend_control_warm_up_pending{model_name="tiny"} 1.0' in text


def test_leaving_requests_are_folded_into_the_histograms_in_batches():
    # More departures than the rows kept before a fold; reading folds the rest.
    stats = RetrievalStats(max_num_reqs=2, device=torch.device("cpu"))
    count = 2 * FINISHED_ROWS + 5
    for request in range(count):
        stats.record_step(torch.tensor([request % 2]), torch.tensor([100]),
                          removed_tokens=torch.tensor([100 - request % 100]),
                          acceptance_lengths=torch.tensor([0]))
        stats.finish_request(request % 2)
    kept = stats.request_kept_fraction.as_dict()
    assert kept["count"] == count == stats.finished_requests
    assert kept["sum"] == pytest.approx(sum(r % 100 / 100 for r in range(count)))
    # None verified a draft; every slot starts from zero again.
    assert stats.request_acceptance_length.as_dict()["count"] == 0
    assert stats.request_figures(0)["verifications"] == 0
