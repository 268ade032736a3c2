"""``benchmarks.gpu_kernels``' results as JSON, a markdown table and a PNG
(one colour per path; a baseline's paths in their own colours)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks.report import fmt, pyplot, save_figure

PATH_COLOURS = {"torch": "tab:blue", "triton": "tab:orange"}
BASELINE_COLOURS = {"torch": "tab:cyan", "triton": "tab:green"}


def _colour(path: str) -> str:
    name, _, baseline = path.partition("@")
    return (BASELINE_COLOURS if baseline else PATH_COLOURS).get(name, "tab:gray")


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _sync_summary(sites: dict) -> str:
    if any(found is None for found in sites.values()):
        return "not checked (no CUDA)"
    listed = sorted({site["site"] for found in sites.values() for site in found})
    return "none" if not listed else "; ".join(listed)


def summary_line(size: dict, path: str, r: dict) -> str:
    """One batch and path, as the run prints it."""
    split = (f" (host {r['plan_host_ms']:.3f}, device {r['device_ms']:.3f})"
             if "device_ms" in r else f" (host {r['plan_host_ms']:.3f})")
    share = r.get("plan_scoring_share_of_copy_bandwidth")
    return (f"{size['batch']} [{size['tokens']:,} tokens]: {path} plan {r['plan_ms']:.3f} ms"
            f"{split}, one read {size['one_read_ms']:.3f} ms ({r['plan_over_one_read']:.1f}x), "
            f"bar {size['bar_ms']:.3f} ms ({r['plan_over_bar']:.2f} of it), scoring "
            + ("-" if share is None else f"{100 * share:.0f}%") + " of copy, "
            f"{100 * r['plan_share_of_decode_floor']:.1f}% of the decode floor, dense error "
            f"{r['plan_max_rel_error_vs_dense']:.1e}")


def write(result: dict, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    layer = result["layer"]
    lines = [
        f"# Retrieval's planning call on {result['device']}", "",
        f"8B-class last layer ({layer['heads']} heads, {layer['kv_heads']} KV heads, head dim "
        f"{layer['head_dim']}, bf16), block {layer['block_size']}, K = {layer['k']}, chunk "
        f"{layer['chunk']}, every row retrieved (scored at its last token); median of "
        f"{result['repeats']} calls. Copy bandwidth measured on the device: "
        f"{result['copy_bandwidth_gb_s']:.0f} GB/s. torch {result['torch']}, triton "
        f"{result['triton']}, commit {result['commit']}.", "",
        f"`{result['command']}`", "",
    ]
    if "baseline" in result:
        base = result["baseline"]
        lines += [f"Baseline (`PATH@{base['commit']}`): the package in `{base['package']}`, "
                  f"measured first in a second process on the same device (copy bandwidth "
                  f"{base['copy_bandwidth_gb_s']:.0f} GB/s there).", ""]
    lines += [
        "| batch (max_model_len) | tokens | path | plan ms, median (min) | host ms | device ms "
        "| launches | one read of the keys ms | plan / one read | bar ms | plan / bar "
        "| scoring in the plan, share of copy | plan / 8B decode floor | plan scores vs dense "
        "(rel) | host syncs |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for size in result["sizes"]:
        for path, r in size["paths"].items():
            lines.append(
                f"| {size['batch']} ({size['max_model_len']}) | {size['tokens']:,} | {path} "
                f"| {r['plan_ms']:.3f} ({r['plan_min_ms']:.3f}) | {r['plan_host_ms']:.3f} "
                f"| {fmt(r.get('device_ms'), '.3f')} | {fmt(r.get('launches_per_call'), '.0f')} "
                f"| {size['one_read_ms']:.3f} | {r['plan_over_one_read']:.1f}x "
                f"| {size['bar_ms']:.3f} | {r['plan_over_bar']:.2f} "
                f"| {_percent(r.get('plan_scoring_share_of_copy_bandwidth'))} "
                f"| {100 * r['plan_share_of_decode_floor']:.1f}% "
                f"| {r['plan_max_rel_error_vs_dense']:.1e} | {_sync_summary(r['sync_sites'])} |")
    lines += [
        "", "Uniform batches, `chunk_attention_sums` on every row's K + 1 query rows:", "",
        "| batch | path | scoring ms, median (min) | GB/s (share of copy) | select ms | rewrite ms "
        "| max error vs dense (abs / rel) | rows keeping the dense blocks |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size in result["sizes"]:
        for path, r in size["paths"].items():
            if "chunk_attention_sums_ms" not in r:
                continue
            lines.append(
                f"| {size['batch']} | {path} | {r['chunk_attention_sums_ms']:.3f} "
                f"({r['chunk_attention_sums_min_ms']:.3f}) | {r['scoring_bandwidth_gb_s']:.0f} "
                f"({_percent(r['scoring_share_of_copy_bandwidth'])}) "
                f"| {r['select_blocks_ms']:.3f} | {r['rewrite_block_table_ms']:.3f} "
                f"| {r['max_abs_error_vs_dense']:.1e} / {r['max_rel_error_vs_dense']:.1e} "
                f"| {_percent(r['rows_keeping_the_dense_blocks'])} |")
    lines += ["", "Host ms: the planning call's time on the host alone (launching, not "
              "waiting); device ms: its kernels' time (torch.profiler). One read of the keys: "
              "the batch's scoring-layer keys at the copy bandwidth; the bar (#47): 2 x that "
              f"or {result['bar_floor_ms']:.1f} ms, whichever is larger. Scoring in the plan: "
              "the keys' bytes over the scoring launches' device time. The decode-step floor: "
              "16 GB of weights and the target's K and V over 32 layers, read once at the copy "
              "bandwidth. Errors: chunk scores against a float32 dense softmax of the same "
              "inputs (tests/dense_reference.py)."]
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
    labels = [size["batch"].replace("+", "+\n") for size in sizes]
    paths = list(dict.fromkeys(p for s in sizes for p in s["paths"]))
    fig, ax = plt.subplots(figsize=(max(8, 1.8 * len(sizes)), 4.5))
    width = 0.8 / len(paths)
    x = np.arange(len(sizes))
    for i, p in enumerate(paths):
        values = [s["paths"][p]["plan_ms"] if p in s["paths"] else np.nan for s in sizes]
        ax.bar(x + i * width, values, width, label=p, color=_colour(p))
    centre = x + 0.4 - width / 2
    ax.plot(centre, [s["bar_ms"] for s in sizes], "k_", markersize=30,
            label="bar: 2 x one read of the keys or 0.3 ms")
    ax.plot(centre, [s["one_read_ms"] for s in sizes], "_", color="tab:red", markersize=30,
            label="one read of the keys")
    ax.set_xticks(centre, labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("planning call, ms")
    ax.set_title(result["device"])
    ax.legend(fontsize=8)
    save_figure(fig, path)
