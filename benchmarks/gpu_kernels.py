"""Retrieval's planning call on a GPU, both paths (the torch tiles and the
Triton kernels), for decode batches of an 8B-class last layer (32 heads,
8 KV heads, head dim 128, bf16, block 16, K = 4, chunk 32, every row
retrieved): the grid's uniform batches and a server's mixed-length batches
under its max_model_len (``benchmarks/gpu_batches.py`` writes them). Needs
torch, numba (and triton on CUDA) only: no vLLM.

For each batch and path it records: the planning call's time (median and
fastest, device-synchronised), its host time alone and its device time (the
kernels' sum, torch.profiler; on CUDA), one read of the batch's keys at the
card's copy bandwidth (measured here) and the plan's ratio to it and to the
bar (#47: 2 x one read or 0.3 ms, whichever is larger), the scoring kernels'
share of copy bandwidth inside the plan, an 8B target's decode-step floor
(16 GB of weights + its KV) and the plan's share of it, the plan's chunk
scores against a float32 dense reference (``tests/dense_reference.py``),
and every host sync found (``torch.cuda.set_sync_debug_mode("warn")``).
Uniform batches also time ``chunk_attention_sums`` on K + 1 query rows
(its share of copy bandwidth, dense check, blocks kept), selection and the
rewrite, as before.

Before / after in one run: ``--baseline DIR`` runs the same measurements,
first, in a second process whose ``vllm_specextend`` is DIR's (a copy of an
older commit's package; this checkout's benchmark drives it through the
planner's API), and the results sit side by side (the baseline's alone in
``OUT/baseline-LABEL``; if its process fails, this checkout is measured alone). On a lent H100, from the
repository root, with the old package made once here (``build/`` is
untracked: carry it to the machine) --

    mkdir -p build/base && git archive 5dc3f39 vllm_specextend | tar -x -C build/base

-- the run (about 3 minutes, both processes' compiles included):

    python3 -m benchmarks.gpu_kernels --device cuda --paths triton --repeats 20 --baseline build/base --baseline-label 5dc3f39 --out "$OUT/gpu-kernels"

(drop ``--paths triton`` to time the torch path too; without matplotlib
there, redraw the PNG with ``--replot DIR``). On CPU (the torch path only,
a reduced grid; default output: build/, untracked):

    python3 -m benchmarks.gpu_kernels --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu_batches import (
    BLOCK_SIZE,
    CHUNK,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    QUERY_ROWS,
    BatchSpec,
    K,
    dense_chunk_sums,
    key_bytes,
    make_inputs,
    parse_grid,
    plan_score_errors,
    planning_batch,
    uniform_query_rows,
)
from benchmarks.gpu_kernels_report import plot, summary_line, write
from benchmarks.report import git_commit
from benchmarks.sync_sites import SyncSites
from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.retrieval.kernels.scoring import ScoringWorkspace, chunk_attention_sums
from vllm_specextend.retrieval.kernels.selection import rewrite_block_table, select_blocks
from vllm_specextend.retrieval.planner import RetrievalPlanner
from vllm_specextend.retrieval.target_tap import TargetAttentionTap

TARGET_WEIGHT_BYTES = 16e9  # an 8B target in bf16
TARGET_LAYERS = 32
PLAN_BAR_FLOOR_S = 0.3e-3
"""#47's bar: a plan within 2 x one read of its keys, or this, whichever is larger."""
GPU_GRID = "8x32768,64x32768,256x4096,4x131072,1x131072+63x1024-32768@131072,256x4096@131072"
CPU_GRID = "2x4096,8x4096,1x16384,1x8192+7x512-4096@8192"
SCORING_KERNELS = ("granule_logsumexp", "row_logsumexp", "chunk_sum", "chunk_scores",
                   "gather_query_rows", "chunk_means")
"""Name parts of the scoring launches inside a planning call (this commit's and older)."""
REPO = Path(__file__).resolve().parent.parent


class _Layer:
    num_heads, num_kv_heads, head_size = HEADS, KV_HEADS, HEAD_DIM


def _workspace(device: torch.device, batch: int, path: str, max_model_len: int):
    options = {}
    if path == "triton":
        options = {"use_kernel": True, "max_context_len": max_model_len}
    elif device.type == "cuda":
        options = {"use_kernel": False}
    return ScoringWorkspace.allocate(HEADS, KV_HEADS, HEAD_DIM, batch, QUERY_ROWS,
                                     torch.bfloat16, device, **options)


def _planner(device, inputs, max_model_len: int, path: str) -> RetrievalPlanner:
    batch = inputs["table"].shape[0]
    config = SpecExtendConfig(mode="cmr", retrieval_interval=1, chunk_size=CHUNK,
                              min_context_tokens=256)
    planner = RetrievalPlanner(config, max_num_reqs=batch, max_model_len=max_model_len,
                               max_num_speculative_tokens=K, draft_window=max_model_len,
                               compact_positions=False, device=device)
    planner.scoring_workspace = _workspace(device, batch, path, max_model_len)
    # The torch path is the whole pure-torch layer: selection and rewrite too.
    planner.use_kernels = path == "triton"
    tap = TargetAttentionTap(num_slots=1, max_num_tokens=inputs["queries"].shape[0],
                             num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             scale=HEAD_DIM ** -0.5, dtype=torch.bfloat16, device=device)
    tap.keys = inputs["keys"]
    tap.queries.copy_(inputs["queries"])
    planner.bind_kv_cache(tap, BLOCK_SIZE)  # warms the kernels up
    return planner


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _times(device, fn, repeats: int) -> list[float]:
    """Seconds of each call after as many warm-up calls, each timed alone
    (device-synchronised). Warm-up: a first call after the kernels compiled
    still loads them; on the H100 the first size's median was 1.6x its
    steady one after a single warm-up call."""
    for _ in range(repeats):
        fn()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def _timed(device, fn, repeats: int) -> float:
    """Median seconds per call."""
    return float(np.median(_times(device, fn, repeats)))


def _host_times(device, fn, repeats: int) -> list[float]:
    """Seconds each call keeps the host (launching, not waiting for the device)."""
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    _synchronize(device)
    return times


def _sync_sites(device: torch.device, calls: dict) -> dict:
    """Each call once under sync-debug mode "warn": every synchronising
    operation's warning, with the innermost frame in the package and the
    whole stack (:class:`~benchmarks.sync_sites.SyncSites`)."""
    if device.type != "cuda":
        return {name: None for name in calls}
    found = {}
    for name, fn in calls.items():
        found[name] = []
        with SyncSites(found[name]):
            fn()
    return found


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    size = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = _timed(device, lambda: dst.copy_(src), 10)
    return 2 * size / seconds


def _profile(device: torch.device, fn, calls: int = 3) -> dict:
    """A planning call's kernels (torch.profiler): their device time, the
    scoring launches' part of it, and the launches, the longest first."""
    from torch.profiler import ProfilerActivity, profile

    _synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _synchronize(device)
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us > 0:
            kernels.append({"name": event.key[:120], "launches_per_call": event.count / calls,
                            "device_us_per_call": device_us / calls})
    kernels.sort(key=lambda k: -k["device_us_per_call"])
    scoring = [k for k in kernels if any(part in k["name"] for part in SCORING_KERNELS)]
    return {"launches_per_call": sum(k["launches_per_call"] for k in kernels),
            "device_ms": 1e-3 * sum(k["device_us_per_call"] for k in kernels),
            "scoring_device_ms": 1e-3 * sum(k["device_us_per_call"] for k in scoring),
            "kernels": kernels[:25]}


def _uniform_scoring(device, spec: BatchSpec, inputs, planner, repeats, bandwidth) -> tuple:
    """``chunk_attention_sums`` on every row's K + 1 query rows, selection
    and the rewrite, timed alone, against the dense reference (as the grid
    was measured before mixed batches)."""
    context = spec.lengths[0]
    batch = len(spec.lengths)
    query_index, query_positions = uniform_query_rows(inputs, device)
    dense = dense_chunk_sums(inputs, query_index, query_positions, context)
    recent = torch.full((batch,), (context - 256) // BLOCK_SIZE, device=device)
    num_blocks = inputs["table"].shape[1]
    kernels = planner.use_kernels
    queries = inputs["queries"][query_index]
    workspace = planner.scoring_workspace

    def select(sums, use_kernel):
        return select_blocks(sums, recent, top_k_chunks=16, sink_blocks=2,
                             blocks_per_chunk=CHUNK // BLOCK_SIZE, num_blocks=num_blocks,
                             use_kernel=use_kernel)

    def score():
        return chunk_attention_sums(queries, query_positions, inputs["keys"], inputs["table"],
                                    context, HEAD_DIM ** -0.5, BLOCK_SIZE, CHUNK, workspace)

    sums = score()
    keep = select(sums, kernels)
    same_rows = (keep == select(dense, False)).all(dim=1)
    score_times = _times(device, score, repeats)
    read_bytes = key_bytes(spec) + batch * QUERY_ROWS * HEADS * HEAD_DIM * 2
    calls = {"chunk_attention_sums": score,
             "select_blocks": lambda: select(sums, kernels),
             "rewrite_block_table": lambda: rewrite_block_table(inputs["table"], keep, BLOCK_SIZE,
                                                                use_kernel=kernels)}
    score_s = float(np.median(score_times))
    return {
        "chunk_attention_sums_ms": 1e3 * score_s,
        "chunk_attention_sums_min_ms": 1e3 * min(score_times),
        "select_blocks_ms": 1e3 * _timed(device, calls["select_blocks"], repeats),
        "rewrite_block_table_ms": 1e3 * _timed(device, calls["rewrite_block_table"], repeats),
        "scoring_bandwidth_gb_s": read_bytes / score_s / 1e9,
        "scoring_share_of_copy_bandwidth": read_bytes / score_s / bandwidth,
        "max_abs_error_vs_dense": float((sums.float() - dense).abs().max()),
        "max_rel_error_vs_dense": float(((sums.float() - dense).abs()
                                         / dense.abs().clamp(min=1e-6)).max()),
        "rows_keeping_the_dense_blocks": float(same_rows.float().mean()),
    }, calls


def run_size(device, spec: BatchSpec, paths: list[str], repeats: int, bandwidth: float,
             profile: bool = False) -> dict:
    inputs = make_inputs(spec, device)
    keys = key_bytes(spec)
    one_read_s = keys / bandwidth
    bar_s = max(2 * one_read_s, PLAN_BAR_FLOOR_S)
    floor_s = (TARGET_WEIGHT_BYTES + 2 * TARGET_LAYERS * keys) / bandwidth
    out = {"batch": spec.label, "rows": len(spec.lengths), "tokens": spec.tokens,
           "longest": max(spec.lengths), "max_model_len": spec.max_model_len,
           "uniform": spec.uniform, "key_bytes": keys, "one_read_ms": 1e3 * one_read_s,
           "bar_ms": 1e3 * bar_s, "decode_step_floor_ms": 1e3 * floor_s, "paths": {}}
    for path in paths:
        planner = _planner(device, inputs, spec.max_model_len, path)
        batches = [planning_batch(device, inputs, step) for step in range(2)]
        planner.plan(batches[0])  # warm-up
        _synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            baseline = torch.cuda.memory_allocated(device)
        plan_times = _times(device, lambda: planner.plan(batches[1]), repeats)
        plan_s = float(np.median(plan_times))
        result = {
            "plan_ms": 1e3 * plan_s,
            # Fastest calls: on a shared host, contention only ever adds time.
            "plan_min_ms": 1e3 * min(plan_times),
            "plan_host_ms": 1e3 * float(np.median(
                _host_times(device, lambda: planner.plan(batches[1]), repeats))),
            "plan_over_one_read": plan_s / one_read_s,
            "plan_over_bar": plan_s / bar_s,
            "plan_share_of_decode_floor": plan_s / floor_s,
            "workspace_mib": planner.scoring_workspace.nbytes / 2**20,
        }
        if device.type == "cuda":
            result["plan_peak_memory_mib"] = (
                torch.cuda.max_memory_allocated(device) - baseline) / 2**20
            found = _profile(device, lambda: planner.plan(batches[1]))
            if not profile:
                found.pop("kernels")
            result.update(found)
            if path == "triton" and found["scoring_device_ms"] > 0:
                result["plan_scoring_share_of_copy_bandwidth"] = (
                    keys / (1e-3 * found["scoring_device_ms"]) / bandwidth)
        planner.plan(batches[1])
        _synchronize(device)
        result.update(plan_score_errors(planner, batches[1], inputs))
        calls = {"plan": lambda: planner.plan(batches[0])}
        if spec.uniform:
            measured, more_calls = _uniform_scoring(device, spec, inputs, planner, repeats,
                                                    bandwidth)
            result.update(measured)
            calls.update(more_calls)
        result["sync_sites"] = _sync_sites(device, calls)
        out["paths"][path] = result
        del planner
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU ({name}, {torch.get_num_threads()} threads)"


def run(args) -> dict:
    device = torch.device(args.device)
    import vllm_specextend
    bandwidth = copy_bandwidth(device)
    result = {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "commit": git_commit(),
        "package": str(Path(vllm_specextend.__file__).parent),
        "command": "python3 -m benchmarks.gpu_kernels " + " ".join(args.argv),
        "layer": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bf16",
                  "block_size": BLOCK_SIZE, "k": K, "query_rows": QUERY_ROWS, "chunk": CHUNK},
        "repeats": args.repeats,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "bar_floor_ms": 1e3 * PLAN_BAR_FLOOR_S,
        "sizes": [],
    }
    for spec in args.grid_specs:
        size = run_size(device, spec, args.path_list, args.repeats, bandwidth, args.profile)
        result["sizes"].append(size)
        for path, r in size["paths"].items():
            print(summary_line(size, path, r), flush=True)
    return result


BASELINE_BOOTSTRAP = """
import sys
here, base, out = sys.argv[1:4]
sys.modules["vllm"] = None  # as on a GPU machine without vLLM
sys.path.insert(0, here)
import benchmarks, tests  # this checkout's benchmark and dense references
sys.path.insert(0, base)  # the package measured: the baseline's
import vllm_specextend
assert vllm_specextend.__file__.startswith(base), vllm_specextend.__file__
from benchmarks.gpu_kernels import main
main(["--out", out, "--no-table", *sys.argv[4:]])
"""


def run_baseline(args, label: str, out: Path) -> dict | None:
    """The same grid and paths, measured in a second process whose
    ``vllm_specextend`` is ``args.baseline``'s (its results also in
    ``out``); None, with the error shown, if that process fails."""
    base = str(Path(args.baseline).resolve())
    forwarded = ["--device", args.device, "--repeats", str(args.repeats),
                 "--grid", ",".join(spec.text for spec in args.grid_specs),
                 "--paths", ",".join(args.path_list)] + (["--profile"] if args.profile else [])
    print(f"== baseline {label} ({base}), in a second process ==", flush=True)
    env = {**os.environ, "SPECEXTEND_COMMIT": label}
    done = subprocess.run([sys.executable, "-c", BASELINE_BOOTSTRAP, str(REPO), base, str(out),
                           *forwarded], env=env)
    if done.returncode:
        print(f"== baseline {label} failed (exit {done.returncode}): measuring this checkout "
              "alone ==", flush=True)
        return None
    return json.loads((out / "results.json").read_text())


def merge_baseline(result: dict, baseline: dict, label: str) -> dict:
    """The baseline's paths beside this checkout's, as ``PATH@LABEL``."""
    result["baseline"] = {key: baseline[key] for key in
                          ("commit", "package", "copy_bandwidth_gb_s", "device")}
    for size, base_size in zip(result["sizes"], baseline["sizes"]):
        assert size["batch"] == base_size["batch"]
        for path, measured in base_size["paths"].items():
            size["paths"][f"{path}@{label}"] = measured
    return result


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--grid", default=None,
                        help="batches, comma-separated (benchmarks/gpu_batches.py: e.g. 8x32768, "
                             "256x4096@131072, 1x131072+63x1024-32768@131072; default: the "
                             "device's grid)")
    parser.add_argument("--paths", type=lambda text: text.split(","), default=None,
                        help="torch,triton (default: both on CUDA, torch on CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: build/gpu-kernels-DEVICE, untracked)")
    parser.add_argument("--profile", action="store_true",
                        help="also record each planning call's kernels (torch.profiler)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a folder holding an older vllm_specextend: measured first, in a "
                             "second process, beside this checkout's")
    parser.add_argument("--baseline-label", default=None,
                        help="the baseline's name in the results (default: its folder's)")
    parser.add_argument("--replot", type=Path, default=None,
                        help="redraw DIR/results.png from DIR/results.json")
    parser.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.replot:
        plot(json.loads((args.replot / "results.json").read_text()), args.replot / "results.png")
        return
    device = torch.device(args.device)
    args.grid_specs = parse_grid(args.grid or (GPU_GRID if device.type == "cuda" else CPU_GRID))
    args.path_list = args.paths or (["torch", "triton"] if device.type == "cuda" else ["torch"])
    out = args.out or REPO / "build" / f"gpu-kernels-{device.type}"
    baseline = None
    if args.baseline:  # first: this process has not touched the device yet
        label = args.baseline_label or Path(args.baseline).resolve().name
        baseline = run_baseline(args, label, out / f"baseline-{label}")
        print(f"== this checkout ({git_commit()}) ==", flush=True)
    result = run(args)
    if baseline:
        result = merge_baseline(result, baseline, label)
    table = write(result, out)
    if not args.no_table:  # (the baseline's process: its parent prints both)
        print(table)


if __name__ == "__main__":
    main()
