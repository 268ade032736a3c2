"""Retrieval's scoring on a GPU, both paths (the torch tiles and the Triton
kernel), for long decode batches of an 8B-class last layer (32 heads,
8 KV heads, head dim 128, bf16, block 16, K = 4, chunk 32, every row
retrieved). Needs torch, numba (and triton on CUDA) only: no vLLM.

For each batch x context and path it records: time per planning call
(score + select + rewrite) and per ``chunk_attention_sums``, the bytes
scoring reads and the bandwidth that makes, an 8B target's decode-step floor
(16 GB of weights + its KV, at the card's copy bandwidth measured here) and
the plan's share of it, the chunk scores' error against a dense float32
reference (``tests/dense_reference.py``, not the other path), whether the
blocks kept from them equal the reference's, and every host sync found in a
planning call and in each function (``torch.cuda.set_sync_debug_mode("warn")``,
warnings and stacks collected).

The H100 run, one call from the repository root (results in
benchmarks/results/gpu-kernels/; ``--profile`` adds each planning call's host
time and kernels):

    python3 -m benchmarks.gpu_kernels --device cuda --repeats 30 --profile --out benchmarks/results/gpu-kernels

(on a lent machine write to ``--out "$OUT/gpu-kernels"`` and copy the folder back; without
matplotlib there, redraw the PNG with ``--replot DIR``).

On CPU (the torch path only, a reduced grid; default output: build/, untracked):

    python3 -m benchmarks.gpu_kernels --device cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.report import git_commit, pyplot, save_figure
from benchmarks.sync_sites import SyncSites
from tests.dense_reference import attention_scores, context_keys
from vllm_specextend.core.options import SpecExtendConfig
from vllm_specextend.core.planner import PlanningBatch, RetrievalPlanner
from vllm_specextend.core.scoring import ScoringWorkspace, chunk_attention_sums
from vllm_specextend.core.selection import rewrite_block_table, select_blocks
from vllm_specextend.core.target_tap import TargetAttentionTap

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_SIZE, K, CHUNK = 16, 4, 32
QUERY_ROWS = K + 1  # an accepted-tokens step scores the K + 1 rows of a request
TARGET_WEIGHT_BYTES = 16e9  # an 8B target in bf16
TARGET_LAYERS = 32
GPU_GRID = [(8, 32768), (64, 32768), (256, 4096), (4, 131072)]
CPU_GRID = [(2, 4096), (8, 4096), (1, 16384)]
PATH_COLOURS = {"torch": "tab:blue", "triton": "tab:orange"}
REPO = Path(__file__).resolve().parent.parent


class _Layer:
    num_heads, num_kv_heads, head_size = HEADS, KV_HEADS, HEAD_DIM


def _inputs(batch: int, context: int, device: torch.device, seed: int = 0) -> dict:
    """One decode step, made on the device: every row at ``context`` tokens,
    its blocks scattered over the key buffer."""
    generator = torch.Generator(device=device).manual_seed(seed)
    num_slots = batch * context
    keys = torch.empty(num_slots, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    for start in range(0, num_slots, 1 << 18):  # in pieces: float32 noise of GiBs is wasteful
        end = min(num_slots, start + (1 << 18))
        keys[start:end] = torch.randn(end - start, KV_HEADS, HEAD_DIM, generator=generator,
                                      device=device)
    queries = torch.randn(batch * QUERY_ROWS, HEADS, HEAD_DIM, generator=generator,
                          device=device).bfloat16()
    table = torch.randperm(batch * context // BLOCK_SIZE, generator=generator, device=device)
    query_lens = np.full(batch, QUERY_ROWS)
    return {
        "keys": keys, "queries": queries, "table": table.int().view(batch, -1),
        "query_lens": query_lens,
        "query_start": np.concatenate([[0], np.cumsum(query_lens)]),
    }


def _workspace(device: torch.device, batch: int, path: str, max_model_len: int):
    # The torch path on CPU passes no new argument, so that this script also
    # measures the code from before the kernel (the CPU before / after check).
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
    planner.bind_kv_cache(tap, BLOCK_SIZE)
    if hasattr(planner.scoring_workspace, "warm_up"):  # absent before the kernel
        planner.scoring_workspace.warm_up(BLOCK_SIZE, CHUNK)
    return planner


def _planning_batch(device, inputs, context: int, step: int) -> PlanningBatch:
    table, query_start = inputs["table"], inputs["query_start"]
    batch = table.shape[0]
    positions = torch.arange(context - QUERY_ROWS, context, device=device).repeat(batch)
    return PlanningBatch(
        req_ids=[f"req-{i}" for i in range(batch)],
        query_start_loc=torch.from_numpy(query_start).int().to(device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_table=table,
        last_token_indices=torch.from_numpy(query_start[1:] - 1 - step % 2).to(device),
        positions=positions,
        query_lens_cpu=inputs["query_lens"],
        context_lens_cpu=np.full(batch, context - QUERY_ROWS),
        prompt_lens_cpu=np.full(batch, 1000),
    )


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


def _dense_chunk_sums(inputs, query_index, query_positions, context: int) -> torch.Tensor:
    """Float32 dense reference, one row at a time (bounded memory)."""
    rows = []
    for row in range(inputs["table"].shape[0]):
        keys = context_keys(inputs["keys"], inputs["table"][row : row + 1], context, BLOCK_SIZE)
        queries = inputs["queries"][query_index[row : row + 1]]
        scores = attention_scores(queries, keys, query_positions[row : row + 1], HEAD_DIM ** -0.5)
        token = scores.sum(dim=1)
        chunks = -(-context // CHUNK)
        token = torch.nn.functional.pad(token, (0, chunks * CHUNK - context))
        rows.append(token.view(1, chunks, CHUNK).sum(dim=-1))
    return torch.cat(rows)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    size = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = _timed(device, lambda: dst.copy_(src), 10)
    return 2 * size / seconds


def _profile(device: torch.device, fn, calls: int = 3) -> dict:
    """Where a planning call's time goes: its host time (launching, no wait),
    the kernels it launches and their device time, the longest first."""
    from torch.profiler import ProfilerActivity, profile

    _synchronize(device)
    host = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
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
    return {"host_ms_per_call": 1e3 * float(np.median(host)),
            "launches_per_call": sum(k["launches_per_call"] for k in kernels),
            "device_us_per_call": sum(k["device_us_per_call"] for k in kernels),
            "kernels": kernels[:25]}


def run_size(device, batch: int, context: int, paths: list[str], repeats: int,
             bandwidth: float, profile: bool = False) -> dict:
    inputs = _inputs(batch, context, device)
    max_model_len = context + 64
    query_index = (torch.from_numpy(inputs["query_start"][1:]).to(device).view(-1, 1)
                   - torch.arange(QUERY_ROWS, 0, -1, device=device).view(1, -1))
    query_positions = torch.arange(context - QUERY_ROWS, context, device=device).repeat(batch, 1)
    dense = _dense_chunk_sums(inputs, query_index, query_positions, context)
    recent = torch.full((batch,), (context - 256) // BLOCK_SIZE, device=device)
    num_blocks = inputs["table"].shape[1]

    def select(sums, use_kernel=False):
        return select_blocks(sums, recent, top_k_chunks=16, sink_blocks=2,
                             blocks_per_chunk=CHUNK // BLOCK_SIZE, num_blocks=num_blocks,
                             use_kernel=use_kernel)

    dense_keep = select(dense)
    key_bytes = batch * context * KV_HEADS * HEAD_DIM * 2
    read_bytes = key_bytes + batch * QUERY_ROWS * HEADS * HEAD_DIM * 2
    kv_bytes = 2 * TARGET_LAYERS * key_bytes
    floor_s = (TARGET_WEIGHT_BYTES + kv_bytes) / bandwidth
    out = {"batch": batch, "context": context, "scoring_bytes_read": read_bytes,
           "target_kv_bytes": kv_bytes, "decode_step_floor_ms": 1e3 * floor_s, "paths": {}}
    for path in paths:
        planner = _planner(device, inputs, max_model_len, path)
        workspace = planner.scoring_workspace
        batches = [_planning_batch(device, inputs, context, step) for step in range(2)]
        queries = inputs["queries"][query_index]

        def score():
            return chunk_attention_sums(queries, query_positions, inputs["keys"],
                                        inputs["table"], context, HEAD_DIM ** -0.5, BLOCK_SIZE,
                                        CHUNK, workspace)

        kernels = path == "triton"
        sums = score()
        keep = select(sums, kernels)
        same_rows = (keep == dense_keep).all(dim=1)
        planner.plan(batches[0])  # warm-up (and Triton's compile)
        _synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            baseline = torch.cuda.memory_allocated(device)
        plan_times = _times(device, lambda: planner.plan(batches[1]), repeats)
        plan_s = float(np.median(plan_times))
        peak = None
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
        score_times = _times(device, score, repeats)
        score_s = float(np.median(score_times))
        calls = {
            "plan": lambda: planner.plan(batches[0]),
            "chunk_attention_sums": score,
            "select_blocks": lambda: select(sums, kernels),
            "rewrite_block_table": lambda: rewrite_block_table(inputs["table"], keep, BLOCK_SIZE,
                                                               use_kernel=kernels),
        }
        out["paths"][path] = {
            "plan_ms": 1e3 * plan_s,
            "chunk_attention_sums_ms": 1e3 * score_s,
            # Fastest calls: on a shared CPU, contention only ever adds time.
            "plan_min_ms": 1e3 * min(plan_times),
            "chunk_attention_sums_min_ms": 1e3 * min(score_times),
            "select_blocks_ms": 1e3 * _timed(device, calls["select_blocks"], repeats),
            "rewrite_block_table_ms": 1e3 * _timed(device, calls["rewrite_block_table"], repeats),
            "scoring_bandwidth_gb_s": read_bytes / score_s / 1e9,
            "scoring_share_of_copy_bandwidth": read_bytes / score_s / bandwidth,
            "plan_share_of_decode_floor": plan_s / floor_s,
            "max_abs_error_vs_dense": float((sums.float() - dense).abs().max()),
            "max_rel_error_vs_dense": float(((sums.float() - dense).abs()
                                             / dense.abs().clamp(min=1e-6)).max()),
            "rows_keeping_the_dense_blocks": float(same_rows.float().mean()),
            "workspace_mib": workspace.nbytes / 2**20,
            "plan_peak_memory_mib": peak,
            "sync_sites": _sync_sites(device, calls),
        }
        if profile and device.type == "cuda":
            out["paths"][path]["profile"] = _profile(device, lambda: planner.plan(batches[1]))
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
    grid = args.grid or (GPU_GRID if device.type == "cuda" else CPU_GRID)
    paths = args.paths or (["torch", "triton"] if device.type == "cuda" else ["torch"])
    bandwidth = copy_bandwidth(device)
    result = {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "commit": git_commit(),
        "command": "python3 -m benchmarks.gpu_kernels " + " ".join(args.argv),
        "layer": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bf16",
                  "block_size": BLOCK_SIZE, "k": K, "query_rows": QUERY_ROWS, "chunk": CHUNK},
        "repeats": args.repeats,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "sizes": [],
    }
    for batch, context in grid:
        result["sizes"].append(run_size(device, batch, context, paths, args.repeats, bandwidth,
                                        args.profile))
        print(f"{batch} x {context}: " + ", ".join(
            f"{path} plan {r['plan_ms']:.2f} ms" for path, r in result["sizes"][-1]["paths"].items()),
            flush=True)
    return result


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _sync_summary(sites: dict) -> str:
    if any(found is None for found in sites.values()):
        return "not checked (no CUDA)"
    listed = sorted({site["site"] for found in sites.values() for site in found})
    return "none" if not listed else "; ".join(listed)


def write(result: dict, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Retrieval scoring on {result['device']}", "",
        f"8B-class last layer (32 heads, 8 KV heads, head dim 128, bf16), block {BLOCK_SIZE}, "
        f"K = {K} ({QUERY_ROWS} query rows a request), chunk {CHUNK}, every row retrieved; "
        f"median of {result['repeats']} calls. Copy bandwidth measured on the device: "
        f"{result['copy_bandwidth_gb_s']:.0f} GB/s. torch {result['torch']}, triton "
        f"{result['triton']}, commit {result['commit']}.", "",
        f"`{result['command']}`", "",
        "| batch x context | path | plan ms, median (min) | plan host ms | scoring ms, median (min) | select ms | rewrite ms | scoring reads "
        "| scoring GB/s (share of copy) | 8B decode-step floor ms | plan / floor | max error vs dense "
        "(abs / rel) | rows keeping the dense blocks | host syncs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for size in result["sizes"]:
        for path, r in size["paths"].items():
            lines.append(
                f"| {size['batch']} x {size['context']} | {path} "
                f"| {r['plan_ms']:.3f} ({r['plan_min_ms']:.3f}) "
                f"| {format(r['profile']['host_ms_per_call'], '.3f') if 'profile' in r else '-'} "
                f"| {r['chunk_attention_sums_ms']:.3f} ({r['chunk_attention_sums_min_ms']:.3f}) "
                f"| {r['select_blocks_ms']:.3f} "
                f"| {r['rewrite_block_table_ms']:.3f} | {size['scoring_bytes_read'] / 1e9:.3f} GB "
                f"| {r['scoring_bandwidth_gb_s']:.0f} ({100 * r['scoring_share_of_copy_bandwidth']:.0f}%) "
                f"| {size['decode_step_floor_ms']:.1f} | {100 * r['plan_share_of_decode_floor']:.1f}% "
                f"| {r['max_abs_error_vs_dense']:.1e} / {r['max_rel_error_vs_dense']:.1e} "
                f"| {100 * r['rows_keeping_the_dense_blocks']:.0f}% | {_sync_summary(r['sync_sites'])} |")
    lines += ["", "Plan host ms: the planning call's time on the host alone (launching, "
              "not waiting; with --profile), where a launch-bound call spends it. "
              "The decode-step floor: 16 GB of weights and the target's K and V over "
              f"{TARGET_LAYERS} layers, read once at the copy bandwidth. Errors: the chunk sums "
              "against a float32 dense softmax of the same inputs (tests/dense_reference.py)."]
    table = "\n".join(lines)
    (out_dir / "results.md").write_text(table + "\n")
    plot(result, out_dir / "results.png")
    return table


def plot(result: dict, path: Path) -> None:
    try:
        plt = pyplot()
    except ImportError:  # a GPU machine with torch only: plot later with --replot
        print(f"matplotlib missing: run `python -m benchmarks.gpu_kernels --replot {path.parent}`")
        return
    sizes = result["sizes"]
    labels = [f"{s['batch']} x {s['context'] // 1024}K" for s in sizes]
    paths = sorted({p for s in sizes for p in s["paths"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(paths)
    for ax, key, title in ((axes[0], "plan_ms", "planning call"),
                           (axes[1], "chunk_attention_sums_ms", "chunk_attention_sums")):
        for i, p in enumerate(paths):
            values = [s["paths"][p][key] if p in s["paths"] else np.nan for s in sizes]
            ax.bar(np.arange(len(sizes)) + i * width, values, width, label=p,
                   color=PATH_COLOURS.get(p, "tab:gray"))
        if ax is axes[0]:
            ax.plot(np.arange(len(sizes)) + 0.4 - width / 2,
                    [s["decode_step_floor_ms"] for s in sizes], "k_", markersize=30,
                    label="8B decode-step floor")
        ax.set_xticks(np.arange(len(sizes)) + 0.4 - width / 2, labels)
        ax.set_yscale("log")
        ax.set_ylabel("ms per call")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(result["device"])
    save_figure(fig, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--grid", type=lambda text: [tuple(int(v) for v in item.split("x"))
                                                     for item in text.split(",")],
                        default=None, help="BATCHxCONTEXT,... (default: the device's grid)")
    parser.add_argument("--paths", type=lambda text: text.split(","), default=None,
                        help="torch,triton (default: both on CUDA, torch on CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: build/gpu-kernels-DEVICE, untracked)")
    parser.add_argument("--profile", action="store_true",
                        help="also record each planning call's kernels (torch.profiler) and host time")
    parser.add_argument("--replot", type=Path, default=None,
                        help="redraw DIR/results.png from DIR/results.json")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.replot:
        plot(json.loads((args.replot / "results.json").read_text()), args.replot / "results.png")
        return
    out = args.out or REPO / "build" / f"gpu-kernels-{torch.device(args.device).type}"
    print(write(run(args), out))


if __name__ == "__main__":
    main()
