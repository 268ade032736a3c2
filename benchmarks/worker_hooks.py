"""What the benchmarks run inside the engine's worker through collective_rpc:
decode-step timers and switching the drafter's options between runs."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

# collective_rpc ships these functions to the worker by pickling them.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def install_timers(worker) -> None:
    """Accumulate wall time of decode steps: the whole runner step, the
    drafter and retrieval. Steps that prefill any request are left out."""
    runner = worker.model_runner
    spec = runner.vllm_config.speculative_config
    max_decode_tokens = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    timers = {"step": 0.0, "steps": 0, "draft": 0.0, "retrieval": 0.0}
    runner._bench_timers = timers
    state = {"decode": False}

    def timed(obj, name, key, starts_step=False):
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            if starts_step:
                scheduler_output = args[0] if args else kwargs["scheduler_output"]
                scheduled = scheduler_output.num_scheduled_tokens
                state["decode"] = bool(scheduled) and max(scheduled.values()) <= max_decode_tokens
                timers["steps"] += state["decode"]
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if state["decode"]:
                    timers[key] += time.perf_counter() - start

        setattr(obj, name, wrapper)

    # Drafting runs in sample_tokens, after execute_model returns.
    timed(runner, "execute_model", "step", starts_step=True)
    timed(runner, "sample_tokens", "step")
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and hasattr(drafter, "propose"):
        timed(drafter, "propose", "draft")
        retrieval = _retrieval(runner)
        if retrieval is not None:
            timed(retrieval, "plan", "retrieval")


def worker_pid(worker) -> int:
    """The worker process (its memory: ``machine.huge_page_share``)."""
    return os.getpid()


def read_timers(worker) -> dict[str, Any]:
    runner = worker.model_runner
    timers = dict(runner._bench_timers)
    retrieval = _retrieval(runner)
    timers["retrieval_stats"] = (
        retrieval.planner.stats.as_dict() if retrieval is not None else None
    )
    return timers


def reconfigure_drafter(worker, options: dict) -> None:
    """Swap the SpecExtend drafter's options between runs, so that one engine
    serves several configurations: retrieval's through its planner's
    ``reconfigure`` (``mode: off`` drafts as stock vLLM does), goodput
    control on or off (switched off, its control rests on the drafter and
    keeps what it learnt about this engine for when it is back on). Each
    feature can only switch in an engine built with it."""
    from vllm_specextend.common.options import SpecExtendConfig, SpecExtendConfigError

    config = SpecExtendConfig.from_dict(options)
    drafter = _drafter(worker.model_runner)
    retrieval = drafter.retrieval
    control = drafter.control or drafter.__dict__.get("benchmark_resting_control")
    for wanted, held, option in ((config.controls_speculation, control,
                                  "speculation_control='goodput'"),
                                 (config.retrieves, retrieval, f"mode={config.mode!r}")):
        if wanted and held is None:
            raise SpecExtendConfigError(
                f"spec_extend option {option} needs an engine built with it; build "
                "the engine with it instead")
    if retrieval is not None:
        retrieval.planner.reconfigure(config)
    if control is not None:
        drafter.benchmark_resting_control = control
        drafter.control = control if config.controls_speculation else None


def control_counts(worker) -> dict | None:
    """Goodput control's engine-wide counters (the benchmarks take their
    differences per run)."""
    control = _control(worker.model_runner)
    if control is None:
        return None
    return {key: value for key, value in control.metrics_snapshot().items()
            if isinstance(value, (int, float, list))}


class PausedController:
    """Stands in for goodput control's controller: every request pauses, and
    the controller neither plans nor learns (the floor of a speculative
    engine that never drafts); its requests and counts are the wrapped one's."""

    def __init__(self, controller) -> None:
        self.wrapped = controller

    def plan(self, req_ids, context_lens, query_lens, prompt_lens, *args, **kwargs):
        import numpy as np

        from vllm_specextend.control.goodput import DraftPlan, decide_draft_forward

        nothing = np.zeros(len(req_ids), dtype=np.int64)
        plan = DraftPlan(nothing, 0, 0.0, nothing)
        decide_draft_forward(plan, np.asarray(context_lens) >= np.asarray(prompt_lens),
                             self.wrapped.free_pause, self.wrapped.defer_prompts)
        return plan

    def observe(self, outcome) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


def force_pause(worker, forced: bool) -> None:
    """Goodput control pauses every request without planning or learning
    (``always_paused``: the engine's floor), or plans again."""
    control = _control(worker.model_runner)
    paused = isinstance(control.controller, PausedController)
    if forced and not paused:
        control.controller = PausedController(control.controller)
    elif paused and not forced:
        control.controller = control.controller.wrapped


def start_control_trace(worker) -> None:
    """Goodput control records every plan from now on: the requests, their
    context, their drafts, whether the draft's forward ran, the clock, the
    tokens caught up so far, the catch-up price and the step-cost weights."""
    control = _control(worker.model_runner)
    trace: list[dict] = []
    control.__dict__.pop("plan_step", None)  # a trace started before: replaced
    stock_plan = control.plan_step

    def plan(req_ids, context_lens, *args, **kwargs):
        now = control.clock()
        draft_plan = stock_plan(req_ids, context_lens, *args, **kwargs)
        runs = draft_plan.runs_draft_forward
        controller = control.controller
        trace.append({"req_ids": list(req_ids), "context_lens": context_lens.tolist(),
                      "draft_lengths": draft_plan.draft_lengths.tolist(),
                      "draft_forward": runs, "seconds": now,
                      "catch_up_tokens_so_far": int(controller.stats.catch_up_tokens),
                      "catch_up_seconds_per_token": controller.cost.catch_up_seconds(),
                      "cost_weights": controller.cost.weights.tolist()})
        return draft_plan

    control.plan_step = plan
    control.trace = trace


def read_control_trace(worker) -> list[dict]:
    return _control(worker.model_runner).trace


def retrieval_refreshes(worker) -> dict[str, int]:
    """Retrievals since engine start, by cause (``retrieval.refresh.REFRESH_CAUSES``)."""
    return dict(_retrieval(worker.model_runner).planner.stats.refreshes)


def _drafter(runner):
    """The runner's drafter (V1 ``drafter`` or MRV2 ``speculator``)."""
    return getattr(runner, "drafter", None) or getattr(runner, "speculator", None)


def _retrieval(runner):
    """The drafter's ``DraftRetrieval``."""
    return getattr(_drafter(runner), "retrieval", None)


def _control(runner):
    """The drafter's goodput control (its ``SpeculationControl``), if on."""
    return getattr(_drafter(runner), "control", None)


PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict[str, Any]:
    """vLLM's spec-decode counters; ``PER_POSITION``: accepted drafts by
    position in the draft (a list)."""
    counters: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name in ("vllm:spec_decode_num_drafts",
                           "vllm:spec_decode_num_accepted_tokens",
                           "vllm:spec_decode_num_draft_tokens"):
            counters[metric.name] = metric.value
        elif metric.name == PER_POSITION:
            counters[metric.name] = list(metric.values)
    return counters


@dataclass
class RunDeltas:
    """What one measured run added to the engine's spec-decode counters
    (``spec_counters``) and to the worker's timers (``read_timers``)."""

    drafts: float
    accepted_tokens: float
    drafted_tokens: float
    steps: int
    step_s: float
    draft_s: float
    retrieval_s: float
    kept_tokens: int | None
    """``kept_tokens`` / ``context_tokens``: retrieval's view of the run
    (None without a SpecExtend drafter)."""
    context_tokens: int | None
    accepted_per_position: list[float]

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def acceptance_per_position(self) -> list[float] | None:
        """Share of drafts whose token at each position was accepted."""
        if not self.drafts:
            return None
        return [accepted / self.drafts for accepted in self.accepted_per_position]


def run_deltas(c0: dict, c1: dict, t0: dict, t1: dict) -> RunDeltas:
    def counter(name: str) -> float:
        return c1.get(f"vllm:spec_decode_{name}", 0) - c0.get(f"vllm:spec_decode_{name}", 0)

    s0, s1 = t0["retrieval_stats"], t1["retrieval_stats"]
    return RunDeltas(
        drafts=counter("num_drafts"),
        accepted_tokens=counter("num_accepted_tokens"),
        drafted_tokens=counter("num_draft_tokens"),
        steps=t1["steps"] - t0["steps"],
        step_s=t1["step"] - t0["step"],
        draft_s=t1["draft"] - t0["draft"],
        retrieval_s=t1["retrieval"] - t0["retrieval"],
        kept_tokens=None if s1 is None else s1["kept_tokens"] - s0["kept_tokens"],
        context_tokens=None if s1 is None else s1["context_tokens"] - s0["context_tokens"],
        accepted_per_position=_differences(c1.get(PER_POSITION, []), c0.get(PER_POSITION, [])),
    )


def _differences(after: list, before: list) -> list:
    """``after - before`` by position; positions ``before`` lacks count from 0
    (vLLM creates the per-position counter at the first draft)."""
    return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]
