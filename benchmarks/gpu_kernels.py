"""Retrieval's pure-torch layer on a GPU (no vLLM needed): the planner's
scoring, selection and block-table rewriting for a batch of long decode rows
of an 8B-class last layer (32 heads, 8 KV heads, head dim 128, bf16).

Records, with the GPU named: equality with the same step on CPU (the kept
blocks and removed tokens exactly; the chunk scores to bf16 tolerance), peak
device memory beyond the inputs, time per planning call and per function,
and that a planning call makes no host sync
(``torch.cuda.set_sync_debug_mode("error")``).

    python -m benchmarks.gpu_kernels                       # batch 64 x 32K on CUDA
    python -m benchmarks.gpu_kernels --device cpu --batch 2 --context 4096  # smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.report import RESULTS_DIR, pyplot, save_figure
from vllm_specextend.core.options import SpecExtendConfig
from vllm_specextend.core.selection import rewrite_block_table, select_blocks
from vllm_specextend.core.planner import PlanningBatch, RetrievalPlanner
from vllm_specextend.core.scoring import chunk_attention_sums
from vllm_specextend.core.target_tap import TargetAttentionTap

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_SIZE = 16
K = 4
RESULTS = RESULTS_DIR / "gpu-kernels"


class _Layer:
    num_heads, num_kv_heads, head_size = HEADS, KV_HEADS, HEAD_DIM


def _inputs(batch: int, context: int, seed: int = 0):
    """Host tensors of one decode step: every row at ``context`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_row = context // BLOCK_SIZE
    num_slots = batch * context
    keys = torch.empty(num_slots, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    for start in range(0, num_slots, 1 << 20):  # in pieces: float32 noise of 4 GiB is wasteful
        end = min(num_slots, start + (1 << 20))
        keys[start:end] = torch.randn(end - start, KV_HEADS, HEAD_DIM, generator=generator)
    queries = torch.randn(batch * (K + 1), HEADS, HEAD_DIM, generator=generator).bfloat16()
    table = torch.randperm(batch * blocks_per_row, generator=generator).int().view(batch, -1)
    query_lens = np.full(batch, K + 1)
    query_start = np.concatenate([[0], np.cumsum(query_lens)])
    return keys, queries, table, query_lens, query_start


def _planner(device, keys, queries, max_model_len, batch):
    config = SpecExtendConfig(mode="cmr", retrieval_interval=1, chunk_size=32,
                              min_context_tokens=256)
    planner = RetrievalPlanner(config, max_num_reqs=batch, max_model_len=max_model_len,
                               max_num_speculative_tokens=K, draft_window=max_model_len,
                               compact_positions=False, device=device)
    planner.allocate_scoring_workspace(_Layer(), torch.bfloat16)
    tap = TargetAttentionTap(num_slots=1, max_num_tokens=queries.shape[0], num_heads=HEADS,
                             num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM ** -0.5,
                             dtype=torch.bfloat16, device=device)
    tap.keys = keys.to(device)
    tap.queries.copy_(queries)
    planner.bind_kv_cache(tap, BLOCK_SIZE)
    return planner


def _batch(device, table, query_lens, query_start, context, step: int) -> PlanningBatch:
    batch = table.shape[0]
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    positions = torch.cat([torch.arange(context - K - 1, context)] * batch)
    return PlanningBatch(
        req_ids=[f"req-{i}" for i in range(batch)],
        query_start_loc=torch.from_numpy(query_start).int().to(device),
        seq_lens=seq_lens.to(device),
        block_table=table.to(device),
        last_token_indices=torch.from_numpy(query_start[1:] - 1 - step % 2).to(device),
        positions=positions.to(device),
        query_lens_cpu=query_lens,
        context_lens_cpu=np.full(batch, context - K - 1),
        prompt_lens_cpu=np.full(batch, 1000),
    )


def _timed(device, fn, repeats: int) -> float:
    """Seconds per call (device-synchronised)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def run(args) -> dict:
    device = torch.device(args.device)
    keys, queries, table, query_lens, query_start = _inputs(args.batch, args.context)
    max_model_len = args.context + 64
    # The reference step on CPU.
    cpu = torch.device("cpu")
    cpu_view = _planner(cpu, keys, queries, max_model_len, args.batch).plan(
        _batch(cpu, table, query_lens, query_start, args.context, 0))

    planner = _planner(device, keys, queries, max_model_len, args.batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    batches = [_batch(device, table, query_lens, query_start, args.context, s) for s in range(2)]
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    view = planner.plan(batches[0])  # raises on any host sync
    plan_s = _timed(device, lambda: planner.plan(batches[1]), args.repeats)
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - baseline
    same_blocks = bool(torch.equal(view.block_table.cpu(), cpu_view.block_table)
                       and torch.equal(view.removed_tokens.cpu(), cpu_view.removed_tokens))

    # The functions one by one, on the planner's inputs.
    workspace = planner.scoring_workspace
    tap = planner.tap
    rows = torch.arange(args.batch, device=device)
    query_index = torch.from_numpy(query_start[1:] - 1).to(device).view(-1, 1)
    query_positions = torch.full((args.batch, 1), args.context - 1, device=device)
    block_table = batches[0].block_table

    def score():
        return chunk_attention_sums(tap.queries[query_index], query_positions, tap.keys,
                                    block_table[rows], args.context, tap.scale, BLOCK_SIZE, 32,
                                    workspace)

    sums = score()
    recent = torch.full((args.batch,), (args.context - 256) // BLOCK_SIZE, device=device)
    num_blocks = block_table.shape[1]

    def select():
        return select_blocks(sums, recent, top_k_chunks=16, sink_blocks=2, blocks_per_chunk=2,
                             num_blocks=num_blocks)

    keep = select()
    cpu_sums = chunk_attention_sums(
        queries[query_index.cpu()], query_positions.cpu(), keys, table, args.context,
        HEAD_DIM ** -0.5, BLOCK_SIZE, 32, workspace_cpu(args.batch))
    return {
        "device": device_name(device),
        "batch": args.batch, "context": args.context,
        "layer": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bf16"},
        "same_kept_blocks_as_cpu": same_blocks,
        "max_chunk_score_diff_vs_cpu": float((sums.float().cpu() - cpu_sums).abs().max()),
        "host_syncs_checked": device.type == "cuda",
        "peak_memory_mib": None if device.type != "cuda" else peak / 2**20,
        "workspace_mib": workspace.nbytes / 2**20,
        "tap_keys_mib": tap.keys.numel() * tap.keys.element_size() / 2**20,
        "seconds_per_call": {
            "plan (score + select + rewrite)": plan_s,
            "chunk_attention_sums": _timed(device, score, args.repeats),
            "select_blocks": _timed(device, select, args.repeats),
            "rewrite_block_table": _timed(
                device, lambda: rewrite_block_table(block_table, keep, BLOCK_SIZE), args.repeats),
        },
    }


def workspace_cpu(batch: int):
    from vllm_specextend.core.scoring import ScoringWorkspace

    return ScoringWorkspace.allocate(HEADS, KV_HEADS, HEAD_DIM, batch, K + 1, torch.bfloat16,
                                     torch.device("cpu"))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def write(result: dict, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    times = result["seconds_per_call"]
    lines = [f"# Retrieval kernels on {result['device']}", "",
             f"Batch {result['batch']} x {result['context']} tokens, 8B-class last layer "
             "(32 heads, 8 KV heads, head dim 128, bf16).", "",
             "| measure | value |", "|---|---:|"]
    lines += [f"| {name} (ms) | {1e3 * s:.3f} |" for name, s in times.items()]
    lines += [f"| kept blocks equal to CPU | {result['same_kept_blocks_as_cpu']} |",
              f"| max chunk-score difference vs CPU | {result['max_chunk_score_diff_vs_cpu']:.2e} |",
              f"| host syncs in a planning call | "
              f"{'none (sync debug mode error)' if result['host_syncs_checked'] else 'not checked (CPU)'} |",
              f"| peak memory beyond inputs (MiB) | {result['peak_memory_mib'] or '-'} |",
              f"| scoring workspace (MiB) | {result['workspace_mib']:.1f} |",
              f"| tapped keys, input (MiB) | {result['tap_keys_mib']:.0f} |"]
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

    times = result["seconds_per_call"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(list(times), [1e3 * s for s in times.values()], color="tab:red")
    ax.set_xlabel("ms per call")
    ax.set_title(f"{result['device']}: batch {result['batch']} x {result['context']}")
    save_figure(fig, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replot", type=Path, default=None,
                        help="redraw DIR/results.png from DIR/results.json")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads((args.replot / "results.json").read_text()), args.replot / "results.png")
        return
    print(write(run(args), args.out))


if __name__ == "__main__":
    main()
