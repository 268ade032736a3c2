"""Retrieval figures in vLLM's Prometheus registry (``/metrics``, ``LLM.get_metrics()``).

The figures live in the worker, next to the drafter. The front-end pulls them
with ``collective_rpc("spec_extend_metrics")`` (rank 0's answer: all ranks
select alike) when ``LLM.get_metrics()`` is called, and in a server each time
vLLM logs its stats (every ``VLLM_LOG_STATS_INTERVAL`` seconds, default 10).
A collector in the default Prometheus registry publishes the latest pull,
labelled by ``model_name`` like vLLM's own metrics. Nothing is registered for
an engine without ``spec_extend``. Like vLLM's own metrics, the figures start
afresh with every engine built in the process: vLLM's ``unregister_vllm_metrics()``
drops every collector whose ``_name`` starts with ``vllm:``, ours included.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

WORKER_METHOD = "spec_extend_metrics"

_COUNTERS = {
    "retrievals": "Per-request selections of the draft's kept KV blocks.",
    "compacted_request_steps": "Request-steps drafted through a compacted block table.",
    "context_tokens": "Context tokens of the compacted drafting steps.",
    "kept_tokens": "Tokens the draft attended to in the compacted drafting steps.",
    "finished_requests": "Requests served by retrieval that left the batch.",
    "layouts_in_place": "Requests laid out in place for want of a free private layout area.",
}
_GAUGES = {
    "kept_fraction": "Kept tokens / context tokens over all compacted drafting steps.",
    "mean_acceptance_length": "Mean tokens per verification of retrieval-served requests.",
    "tracked_requests": "Requests holding per-request retrieval state now.",
    "private_layout_areas": "Private draft layout areas (compact positions, prefix caching).",
}
_CONTROL_COUNTERS = {
    "drafted_request_steps": "Goodput control: request-steps with at least one draft.",
    "paused_request_steps": "Goodput control: request-steps without drafts (paused).",
    "probes": "Goodput control: drafts planned to re-measure a paused request.",
    "forced_draft_seconds": "Goodput control: seconds that steps with only forced drafts "
                            "(probes, explorations, a priced warm-up) took beyond the step "
                            "without drafts.",
    "forced_priced_seconds": "Goodput control: what the step-cost model priced those steps "
                             "at beyond the step without drafts, as they ran (not the "
                             "warm-up's, which has its own price).",
    "host_seconds": "Goodput control: seconds its planning took on the host, charged to "
                    "the probe budget beside forced drafts.",
    "explorations": "Goodput control: steps planned against its choice (every request "
                    "drafting D, or none) to keep measuring each number of draft steps.",
    "skipped_draft_forwards": "Goodput control: steps where no request drafted and the "
                              "draft's forward did not run.",
    "catch_up_tokens": "Goodput control: tokens the draft caught up after pauses.",
    "deferred_prefill_tokens": "Goodput control: prompt tokens not run through the draft "
                               "(nobody drafted, a new request would not have either).",
}
_CONTROL_GAUGES = {
    "warm_up_pending": "Goodput control: 1 until its warm-up drafted (priced, it waits "
                       "until the probe budget covers it), then 0.",
}
_HISTOGRAMS = {
    "request_kept_fraction": "Per finished request: kept tokens / context tokens.",
    "request_acceptance_length": "Per finished request: mean tokens per verification.",
}


def worker_metrics(worker: Any) -> dict[str, Any] | None:
    """``Worker.spec_extend_metrics``: the drafter's figures, if it retrieves
    (``drafter`` in vLLM's V1 runner, ``speculator`` in Model Runner V2)."""
    from vllm_specextend.drafters.features import DrafterFeatures

    runner = getattr(worker, "model_runner", None)
    for name in ("drafter", "speculator"):
        drafter = getattr(runner, name, None)
        if isinstance(drafter, DrafterFeatures):
            return drafter.metrics_snapshot()
    return None


class SpecExtendCollector:
    """Publishes the latest pulled snapshot of each model's retrieval figures."""

    # vLLM's unregister_vllm_metrics() drops collectors by this attribute.
    _name = "vllm:spec_extend"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshots: dict[str, dict[str, Any]] = {}

    def update(self, model_name: str, snapshot: dict[str, Any] | None) -> None:
        if snapshot is not None:
            with self._lock:
                self._snapshots[model_name] = snapshot

    def snapshot(self, model_name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._snapshots.get(model_name)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        with self._lock:
            everything = dict(self._snapshots)
        # Goodput control without retrieval (mode off) has control figures only.
        snapshots = {model: snap for model, snap in everything.items() if "refreshes" in snap}
        controlled = {model: snap["control"] for model, snap in everything.items()
                      if snap.get("control") is not None}
        if controlled:
            yield from _control_families(controlled, CounterMetricFamily, GaugeMetricFamily,
                                         HistogramMetricFamily)
        if not snapshots:
            return
        for key, doc in _COUNTERS.items():
            family = CounterMetricFamily(f"vllm:spec_extend_{key}", doc, labels=["model_name"])
            for model, snap in snapshots.items():
                family.add_metric([model], snap[key])
            yield family
        for key, doc in _GAUGES.items():
            family = GaugeMetricFamily(f"vllm:spec_extend_{key}", doc, labels=["model_name"])
            for model, snap in snapshots.items():
                family.add_metric([model], snap[key])
            yield family
        family = CounterMetricFamily("vllm:spec_extend_refreshes",
                                     "Retrievals by cause: a request's first selection, "
                                     "the fixed interval, or a drop of its acceptance.",
                                     labels=["model_name", "cause"])
        for model, snap in snapshots.items():
            for cause, count in snap["refreshes"].items():
                family.add_metric([model, cause], count)
        yield family
        for key, doc in _HISTOGRAMS.items():
            yield _histogram_family(HistogramMetricFamily, f"vllm:spec_extend_{key}", doc,
                                    {model: snap[key] for model, snap in snapshots.items()})


def _control_families(controlled: dict[str, dict[str, Any]], counter: Any, gauge: Any,
                      histogram: Any) -> Iterator[Any]:
    for kinds, family_type in ((_CONTROL_COUNTERS, counter), (_CONTROL_GAUGES, gauge)):
        for key, doc in kinds.items():
            family = family_type(f"vllm:spec_extend_control_{key}", doc, labels=["model_name"])
            for model, control in controlled.items():
                family.add_metric([model], control[key])
            yield family
    family = counter("vllm:spec_extend_control_chosen_draft_length",
                     "Goodput control: request-steps by the number of drafts chosen.",
                     labels=["model_name", "draft_length"])
    for model, control in controlled.items():
        for length, count in enumerate(control["chosen_draft_lengths"]):
            family.add_metric([model, str(length)], count)
    yield family
    yield _histogram_family(
        histogram, "vllm:spec_extend_control_request_paused_fraction",
        "Goodput control, per finished request: decode steps without drafts / decode steps.",
        {model: control["request_paused_fraction"] for model, control in controlled.items()})


def _histogram_family(histogram: Any, name: str, doc: str,
                      per_model: dict[str, dict[str, Any]]) -> Any:
    family = histogram(name, doc, labels=["model_name"])
    for model, hist in per_model.items():
        bounds = [str(b) for b in hist["buckets"]] + ["+Inf"]
        family.add_metric([model], list(zip(bounds, hist["cumulative_counts"])), hist["sum"])
    return family


_collector: SpecExtendCollector | None = None
_collector_lock = threading.Lock()


def collector() -> SpecExtendCollector:
    """The process's collector, registered with Prometheus on first use and
    replaced by an empty one once vLLM has unregistered it (a new engine)."""
    global _collector
    from prometheus_client import REGISTRY

    with _collector_lock:
        # vLLM reads the same private map in unregister_vllm_metrics().
        if _collector is None or _collector not in REGISTRY._collector_to_names:
            _collector = SpecExtendCollector()
            REGISTRY.register(_collector)
        return _collector


def publish(vllm_config: Any, worker_results: list[dict[str, Any] | None]) -> None:
    """Publish the answer of ``collective_rpc(WORKER_METHOD)`` (rank 0's)."""
    snapshot = next((r for r in worker_results if r is not None), None)
    collector().update(str(vllm_config.model_config.served_model_name), snapshot)
