"""Host time per engine step at a large batch, device work excluded.

What runs on the host every step besides vLLM's own Python:

- the request slots both features share (``common/request_slots.py``):
  arrivals and departures, with each feature's handling of them;
- the planner's Python (``retrieval/planner.py``, ``retrieval/request_rows.py``):
  row classification, index staging and the bookkeeping of the rows that
  retrieved;
- goodput control's (``control/speculation_control.py``): its ``plan``
  (frontiers, the controller's ``plan`` in ``control/goodput.py`` with its cost
  and acceptance observations) and ``catch_up_starts``.

Device work is excluded: the planner runs on the ``meta`` device (tensor ops
are dispatched, nothing is computed) with scoring stubbed by one op (its
torch path issues hundreds of ops; ``benchmarks/gpu_kernels.py`` measures
scoring), and the Python parts are timed around the methods that do them
(the thread's CPU time, ``time.thread_time``, so time spent descheduled on a
shared machine is not counted), less the device ops a leaving request runs. Goodput
control is numpy and numba-compiled loops. The planner's tensor ops per step are counted (each is
one kernel launch on CUDA). The requests decode with K drafts, accept at a
per-request rate, and are replaced by new ones (a prompt chunk, then
decoding) as they finish.

    python -m benchmarks.host_time                       # batch 256, 4K contexts
    python -m benchmarks.host_time --batch 8 --steps 50  # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.report import RESULTS_DIR, git_commit, pyplot, save_figure
from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.control.speculation_control import SpeculationControl
from vllm_specextend.retrieval.counters import FINISHED_ROWS, RetrievalStats
from vllm_specextend.retrieval.planner import RetrievalPlanner
from vllm_specextend.retrieval.target_tap import TargetAttentionTap

META = torch.device("meta")
BLOCK_SIZE = 16
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BAR_MS = 0.3
CLOCK = time.thread_time
"""CPU time of this thread: time spent descheduled (a shared machine) is not
counted, the host work itself is."""
RESULTS = RESULTS_DIR / "host-time"

SLOT_PARTS = {"request_slots": "request slots: arrivals and departures (both features)"}
PLANNER_PARTS = {
    "_classify_rows": "planner: row classification and retrieval bookkeeping",
    "_stage": "planner: index staging",
}
CONTROL_PARTS = {
    "controller_plan": "goodput: controller plan (control/goodput.py)",
    "control_plan_rest": "goodput: frontiers and blocks (speculation_control.py plan)",
    "catch_up_starts": "goodput: catch_up_starts",
}
EXCLUDED_TENSOR_WORK = "stats_device_ops"
"""Device ops inside the planner's bookkeeping (a leaving request's figures
folded into the device histograms): timed and subtracted."""
PART_COLORS = {
    "request_slots": "tab:pink", "_classify_rows": "tab:red", "_stage": "tab:orange",
    "controller_plan": "tab:blue",
    "control_plan_rest": "tab:cyan", "catch_up_starts": "tab:purple",
}


class _Timers:
    """Seconds spent in wrapped methods this step, each exclusive of the
    wrapped methods it calls."""

    def __init__(self) -> None:
        self.step: dict[str, float] = {}
        self._open: list[str] = []

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        method = getattr(owner, name)
        label = label or name

        def timed(*args, **kwargs):
            self._open.append(label)
            start = CLOCK()
            try:
                return method(*args, **kwargs)
            finally:
                seconds = CLOCK() - start
                self._open.pop()
                self.step[label] = self.step.get(label, 0.0) + seconds
                if self._open:
                    caller = self._open[-1]
                    self.step[caller] = self.step.get(caller, 0.0) - seconds

        setattr(owner, name, timed)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _Requests:
    """A batch of ``batch`` requests decoding at their own acceptance rates;
    one that reaches its length leaves and a new one arrives (one prompt
    chunk, then decoding)."""

    def __init__(self, batch: int, context: int, k: int, seed: int,
                 output_tokens: tuple[int, int] = (64, 1024)) -> None:
        self.rng = np.random.default_rng(seed)
        self.k, self.context, self.output_tokens = k, context, output_tokens
        self.next_id = 0
        self.ids = [self._new_id() for _ in range(batch)]
        self.prompt_lens = np.full(batch, context, dtype=np.int64)
        self.context_lens = context + self.rng.integers(0, 512, batch)
        self.query_lens = np.ones(batch, dtype=np.int64)
        self.rates = self.rng.uniform(0.3, 0.9, batch)
        self.ends = self.context_lens + self.rng.integers(*output_tokens, batch)

    def _new_id(self) -> str:
        self.next_id += 1
        return f"req-{self.next_id}"

    def advance(self, draft_lengths: np.ndarray) -> None:
        """This step verified: a decoding row gains its accepted drafts + 1,
        a prompt chunk its tokens; the next query holds the new drafts + 1."""
        decoding = self.context_lens >= self.prompt_lens
        accepted = np.minimum(self.rng.geometric(1 - self.rates) - 1, self.query_lens - 1)
        self.context_lens = self.context_lens + np.where(decoding, accepted + 1, self.query_lens)
        self.query_lens = (np.asarray(draft_lengths) + 1).astype(np.int64)
        for row in np.flatnonzero(self.context_lens >= self.ends).tolist():
            self.ids[row] = self._new_id()
            self.prompt_lens[row] = self.context
            self.context_lens[row] = 0
            self.query_lens[row] = self.context  # one prompt chunk
            self.rates[row] = self.rng.uniform(0.3, 0.9)
            self.ends[row] = self.context + self.rng.integers(*self.output_tokens)


def _planning_batch(requests: _Requests, k: int, max_blocks: int) -> PlanningBatch:
    batch = len(requests.ids)
    num_tokens = int(requests.query_lens.sum())
    return PlanningBatch(
        req_ids=list(requests.ids),
        query_start_loc=torch.empty(batch + 1, dtype=torch.int32, device=META),
        seq_lens=torch.empty(batch, dtype=torch.int32, device=META),
        block_table=torch.empty(batch, max_blocks, dtype=torch.int32, device=META),
        last_token_indices=torch.empty(batch, dtype=torch.int64, device=META),
        positions=torch.empty(num_tokens, dtype=torch.int64, device=META),
        query_lens_cpu=requests.query_lens.copy(),
        context_lens_cpu=requests.context_lens.copy(),
        prompt_lens_cpu=requests.prompt_lens.copy(),
    )


def _planner(args, requests: RequestSlots) -> RetrievalPlanner:
    config = SpecExtendConfig(mode="cmr", retrieval_interval=args.retrieval_interval)
    max_model_len = 2 * args.context + 2048
    planner = RetrievalPlanner(config, max_num_reqs=args.batch, max_model_len=max_model_len,
                               max_num_speculative_tokens=args.k, draft_window=max_model_len,
                               compact_positions=False, device=META, requests=requests)
    layer = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    planner.allocate_scoring_workspace(layer, torch.bfloat16)
    tap = TargetAttentionTap(num_slots=args.batch * max_model_len,
                             max_num_tokens=args.batch * (args.k + 1), num_heads=HEADS,
                             num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM ** -0.5,
                             dtype=torch.bfloat16, device=META)
    planner.bind_kv_cache(tap, BLOCK_SIZE)
    return planner


def measure(args) -> dict:
    # Shared by both features, as an adapter shares them.
    slots = RequestSlots(args.batch)
    planner = _planner(args, slots)
    timers = _Timers()
    timers.wrap(slots, "update", "request_slots")
    for name in PLANNER_PARTS:
        timers.wrap(planner, name)
    for name in ("finish_request", "clear_slot"):
        timers.wrap(planner.stats, name, EXCLUDED_TENSOR_WORK)
    torch_scoring = planner._chunk_scores

    def stub_scoring(rows_t, batch, seq_lens, num_query_rows):
        return torch.zeros(rows_t.shape[0], -(-int(seq_lens.max()) // planner.chunk_size),
                           device=META)

    planner._chunk_scores = stub_scoring
    control = SpeculationControl(args.batch, args.k, free_pause=True, synced_lead=1,
                                 defer_prompts=True, requests=slots)
    clock = [0.0]
    control.clock = lambda: clock[0]
    timers.wrap(control.controller, "plan", "controller_plan")
    max_blocks = -(-planner.max_model_len // BLOCK_SIZE)
    table = np.arange(args.batch * max_blocks, dtype=np.int32).reshape(args.batch, max_blocks)
    requests = _Requests(args.batch, args.context, args.k, args.seed,
                         tuple(args.output_tokens))
    steps, plan_totals, op_counts = [], [], []
    for step in range(args.warmup + args.steps):
        batch = _planning_batch(requests, args.k, max_blocks)
        timers.step = {}
        slots.update(requests.ids)  # the adapter's one update a step, before either feature
        start = CLOCK()
        plan = control.plan_step(requests.ids, requests.context_lens, requests.query_lens,
                                 requests.prompt_lens, table, BLOCK_SIZE)
        runs = plan.runs_draft_forward
        control_seconds = CLOCK() - start
        if runs:
            start = CLOCK()
            # The drafter's token budget (V1: max_num_batched_tokens 8192).
            control.catch_up_starts(requests.ids, requests.context_lens, max(
                0, 8192 - int(requests.query_lens.sum()) - 2 * args.batch))
            timers.step["catch_up_starts"] = CLOCK() - start
        # Less the parts timed inside it.
        timers.step["control_plan_rest"] = control_seconds - sum(
            timers.step.get(name, 0.0) for name in ("controller_plan", EXCLUDED_TENSOR_WORK))
        counter = _OpCounter() if step == args.warmup else None
        start = CLOCK()
        if counter is not None:
            with counter:
                planner.plan(batch)
            op_counts.append(counter.ops)
        else:
            planner.plan(batch)
        plan_seconds = CLOCK() - start
        if step >= args.warmup:
            steps.append(dict(timers.step))
            plan_totals.append(plan_seconds)
        # A step costs 25-40 ms on a GPU at this batch: the controller's clock.
        clock[0] += 0.025 + 2e-5 * float(requests.query_lens.sum()) + 3e-3 * plan.draft_steps
        requests.advance(plan.draft_lengths if runs else np.zeros(args.batch, np.int64))
    torch_scoring_ops = _count_torch_scoring_ops(planner, torch_scoring, requests, args,
                                                 max_blocks)
    departure_ops, fold_ops = _count_departure_ops(args.batch)
    parts = {}
    labels = {**SLOT_PARTS, **PLANNER_PARTS, **CONTROL_PARTS}
    for name, label in labels.items():
        values = np.array([s.get(name, 0.0) for s in steps]) * 1e3
        parts[name] = {"label": label,
                       "median_ms": float(np.median(values)),
                       "p90_ms": float(np.percentile(values, 90)),
                       "mean_ms": float(values.mean())}
    slots_ms, planner_ms, control_ms = (
        np.array([sum(s.get(n, 0.0) for n in names) for s in steps]) * 1e3
        for names in (SLOT_PARTS, PLANNER_PARTS, CONTROL_PARTS))
    stats = control.controller.stats
    return {
        "parts": parts,
        "request_slots_ms": _summary(slots_ms),
        "planner_python_ms": _summary(planner_ms),
        "goodput_python_ms": _summary(control_ms),
        "together_ms": _summary(slots_ms + planner_ms + control_ms),
        "planner_plan_on_meta_ms": _summary(np.array(plan_totals) * 1e3),
        "excluded_stats_device_ops_ms": _summary(
            np.array([s.get(EXCLUDED_TENSOR_WORK, 0.0) for s in steps]) * 1e3),
        "planner_tensor_ops_per_step": op_counts[0] if op_counts else None,
        "torch_scoring_ops_per_step": torch_scoring_ops,
        "tensor_ops_per_departure": departure_ops,
        "tensor_ops_per_fold": fold_ops,
        "drafted_request_steps": stats.drafted_request_steps,
        "paused_request_steps": stats.paused_request_steps,
        "retrievals": planner.stats.retrievals,
    }


GOODPUT_FUNCTIONS = {
    "kv_frontiers": ("advance", "end_step"),
    "controller": ("_explore", "_settle", "_noted", "_decide_forward"),
}


COMPILED_STEPS = ("step_rows", "plan_rows")
"""The controller's compiled calls per step (``control/plan_kernels.py``):
what the step verified, then forced drafts, the K choice and bookkeeping."""


def goodput_breakdown(args) -> dict:
    """Goodput control alone, the same steps again, with its functions timed
    one by one, each exclusive of the others (``controller_plan``: its own
    lines, per-request loops and list comprehensions among them;
    ``control_plan``: ``SpeculationControl.plan_step``'s own lines)."""
    from vllm_specextend.control import goodput

    control = SpeculationControl(args.batch, args.k, free_pause=True, synced_lead=1,
                                 defer_prompts=True)
    clock = [0.0]
    control.clock = lambda: clock[0]
    timers = _Timers()
    for part, names in GOODPUT_FUNCTIONS.items():
        for name in names:
            timers.wrap(getattr(control, part), name)
    timers.wrap(control.requests, "of_step", "request_slots")
    timers.wrap(control.controller, "choose", "controller_plan")
    timers.wrap(control, "plan_step", "control_plan")
    kernels = {name: getattr(goodput, name) for name in COMPILED_STEPS}
    for name in COMPILED_STEPS:
        timers.wrap(goodput, name)
    max_blocks = -(-(2 * args.context + 2048) // BLOCK_SIZE)
    table = np.arange(args.batch * max_blocks, dtype=np.int32).reshape(args.batch, max_blocks)
    requests = _Requests(args.batch, args.context, args.k, args.seed,
                         tuple(args.output_tokens))
    steps = []
    try:
        for step in range(args.warmup + args.steps):
            timers.step = {}
            plan = control.plan_step(requests.ids, requests.context_lens, requests.query_lens,
                                     requests.prompt_lens, table, BLOCK_SIZE)
            runs = plan.runs_draft_forward
            if step >= args.warmup:
                steps.append(dict(timers.step))
            clock[0] += 0.025 + 2e-5 * float(requests.query_lens.sum()) + 3e-3 * plan.draft_steps
            requests.advance(plan.draft_lengths if runs else np.zeros(args.batch, np.int64))
    finally:
        for name, kernel in kernels.items():
            setattr(goodput, name, kernel)
    names = ["controller_plan", *COMPILED_STEPS, *GOODPUT_FUNCTIONS["controller"],
             "control_plan", *GOODPUT_FUNCTIONS["kv_frontiers"], "request_slots"]
    return {name: float(np.median([s.get(name, 0.0) for s in steps]) * 1e3)
            for name in names}


def _count_torch_scoring_ops(planner, torch_scoring, requests, args, max_blocks) -> int:
    """The torch scoring path's ops for one step's due rows (a quarter of
    the batch at the default interval), for scale."""
    due = max(1, args.batch // args.retrieval_interval)
    batch = _planning_batch(requests, args.k, max_blocks)
    rows = torch.empty(due, dtype=torch.int64, device=META)
    counter = _OpCounter()
    with counter:
        torch_scoring(rows, batch, np.full(due, int(requests.context_lens.max()) + args.k + 1), 1)
    return counter.ops


def _count_departure_ops(batch: int) -> tuple[int, int]:
    """Tensor ops of one leaving request's figures (kept for the histograms),
    and of folding ``FINISHED_ROWS`` of them into the histograms."""
    stats = RetrievalStats(max_num_reqs=batch, device=META)
    counter = _OpCounter()
    with counter:
        stats.finish_request(0)
    departure = counter.ops
    stats._unfolded = FINISHED_ROWS - 1
    counter = _OpCounter()
    with counter:
        stats.finish_request(0)
    return departure, counter.ops - departure


def _summary(values: np.ndarray) -> dict:
    return {"median": float(np.median(values)), "p10": float(np.percentile(values, 10)),
            "p90": float(np.percentile(values, 90)), "mean": float(values.mean())}


def _machine() -> dict:
    from benchmarks.machine import cpu_model

    name, _ = cpu_model()
    return {"hostname": platform.node(), "platform": platform.platform(), "cpu_model": name,
            "python": platform.python_version(), "numpy": np.__version__,
            "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0]}


def report(results: dict) -> str:
    r = results["measurement"]
    args = results["args"]
    lines = [
        f"# Host time per step: batch {args['batch']}, {args['context']}-token prompts, "
        f"{args['output_tokens'][0]}-{args['output_tokens'][1]} tokens of output, K = {args['k']}",
        "",
        f"Machine: {results['machine']['cpu_model']} ({results['machine']['hostname']}), "
        f"torch {results['machine']['torch']}, numpy {results['machine']['numpy']}. "
        f"Commit {results['commit']}. Command: `{results['command']}`.",
        "",
        f"{args['steps']} steps after {args['warmup']} of warm-up. Device work excluded: the "
        "planner runs on the meta device with scoring stubbed, and each part is timed around "
        "the method that does it (exclusive of the device ops it calls), in the thread's CPU "
        "time; goodput control is numpy and numba-compiled loops. Load average (1 min) at the start: "
        f"{results['machine']['load_average_1m']:.1f} on {results['machine']['cpu_count']} "
        "CPUs (a shared machine: medians are the figures to read).",
        "",
        "| part | median ms | p90 ms | mean ms |",
        "|---|---:|---:|---:|",
    ]
    for part in r["parts"].values():
        lines.append(f"| {part['label']} | {part['median_ms']:.3f} | {part['p90_ms']:.3f} | "
                     f"{part['mean_ms']:.3f} |")
    for key, label in (("request_slots_ms", "**request slots**"),
                       ("planner_python_ms", "**planner, Python**"),
                       ("goodput_python_ms", "**goodput control, Python**"),
                       ("together_ms", f"**together (bar: {BAR_MS} ms)**")):
        summary = r[key]
        lines.append(f"| {label} | {summary['median']:.3f} | {summary['p90']:.3f} | "
                     f"{summary['mean']:.3f} |")
    lines += [
        "",
        f"- The planner's whole `plan()` on meta (its tensor ops dispatched to meta kernels, "
        f"scoring stubbed): median {r['planner_plan_on_meta_ms']['median']:.3f} ms; meta "
        "kernels are not CUDA launches, so this is not a CUDA figure.",
        f"- Excluded from the request slots' part: the device ops that keep a leaving request's "
        f"figures for the device histograms (on meta: median "
        f"{r['excluded_stats_device_ops_ms']['median']:.3f} ms, p90 "
        f"{r['excluded_stats_device_ops_ms']['p90']:.3f} ms).",
        f"- Tensor ops of a leaving request's figures: {r['tensor_ops_per_departure']}, and "
        f"{r['tensor_ops_per_fold']} every {FINISHED_ROWS} departures to fold them into the "
        "histograms.",
        f"- Tensor ops the planner issues per step (scoring stubbed): "
        f"{r['planner_tensor_ops_per_step']}; the torch scoring path for "
        f"{max(1, args['batch'] // args['retrieval_interval'])} due rows: "
        f"{r['torch_scoring_ops_per_step']} ops.",
        f"- Request-steps drafted / paused by goodput control: {r['drafted_request_steps']} / "
        f"{r['paused_request_steps']}; retrievals: {r['retrievals']}.",
    ]
    lines += ["", "Goodput control's functions (a second run, each timed alone; medians):", "",
              "| function | median ms |", "|---|---:|"]
    for name, value in results["goodput_breakdown_ms"].items():
        lines.append(f"| `{name}` | {value:.3f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    r = results["measurement"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    left = 0.0
    for name, part in r["parts"].items():
        ax.barh(["median per step"], [part["median_ms"]], left=left, color=PART_COLORS[name],
                label=part["label"])
        left += part["median_ms"]
    ax.axvline(BAR_MS, color="black", linestyle="--", label=f"bar: {BAR_MS} ms")
    ax.set_xlabel("host ms per step")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2)
    args = results["args"]
    save_figure(fig, path, f"Host time per step, batch {args['batch']}, "
                           f"{results['machine']['cpu_model']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--retrieval-interval", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[64, 1024],
                        metavar=("LOW", "HIGH"),
                        help="each request's decode length, uniform in [LOW, HIGH) (longer: "
                             "fewer arrivals, more decode-only steps)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = {
        "machine": _machine(),
        "command": "python -m benchmarks.host_time " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "commit": git_commit(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "measurement": measure(args),
        "goodput_breakdown_ms": goodput_breakdown(args),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results)
    (args.out / "results.md").write_text(text)
    plot(results, args.out / "results.png")
    print(text)


if __name__ == "__main__":
    main()
