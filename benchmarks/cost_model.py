"""Step-cost model of the batched benchmark (``benchmarks/results/batch``).

Decode throughput is ``tokens per step / step time``, with a step = target
verification + K draft passes + retrieval. Tokens per step are measured (the
batch's decode tokens over its decode steps): ``batch x acceptance length``
would overstate them, because a batch runs until its slowest request is done
and its last steps carry fewer requests. From the measured components this
writes, next to the batch results:

- the CPU limit of cmr: its throughput if its draft step cost what the draft
  step costs at 1K context (about its working cache: sink 32 + 512 retrieved +
  256 recent tokens + the query), with cmr's measured verification, retrieval
  and tokens per step; its speedup over stock at that limit, and the share of
  the limit cmr reaches;
- a roofline projection of the same grid to one H100 SXM: each step reads the
  weights and the KV cache it attends to from HBM at 3.35 TB/s (decode at
  these batch sizes is bandwidth-bound), with the tokens per step measured
  here (greedy, same models). A projection, not a measurement.

    python -m benchmarks.cost_model [--results benchmarks/results/batch [MORE ...]]

Several folders are read as one grid (same models, K, options and CPU; e.g.
a 1K run added to a batch size measured at 4K and 8K); the model is written
into the first.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

from benchmarks.batch import plot_by_batch_size
from benchmarks.report import RESULTS_DIR, fmt, fmt_ratio
from benchmarks.runs import scheduled_k

H100_SXM_BYTES_PER_S = 3.35e12
"""HBM3 bandwidth of one H100 SXM (NVIDIA's datasheet)."""
WORKING_CACHE_TOKENS = 32 + 512 + 256 + 8
"""cmr's default working cache: sink + retrieved + recent + query (K=4)."""
LIMIT_CONTEXT = 1024
"""The measured context whose draft step stands for a working-cache draft."""
NO_LIMIT_ROWS = (f"No limit: it needs cmr measured at {LIMIT_CONTEXT} context at the same batch "
                 "size (pass that run's folder too).")


def tokens_per_step(row: dict) -> float:
    """Decode tokens per decode step of a measured run (its first token of
    each request comes from the untimed prefill step)."""
    return (row["output_tokens"] - row["batch_size"]) / row["decode_steps"]


def model_bytes(model_dir: Path) -> dict[str, float]:
    """Weight bytes (safetensors headers) and KV bytes per token (config)."""
    weights = 0
    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        weights += sum(v["data_offsets"][1] - v["data_offsets"][0]
                       for k, v in header.items() if k != "__metadata__")
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    key_bytes = config["num_key_value_heads"] * head_dim * 2  # one layer's keys, bf16
    return {"weight_bytes": weights,
            "kv_bytes_per_token": config["num_hidden_layers"] * 2 * key_bytes,
            "last_layer_key_bytes_per_token": key_bytes}


def cpu_limits(rows: list[dict]) -> list[dict]:
    by_key = {(r["config"], r["batch_size"], r["context_tokens"]): r for r in rows}
    limits = []
    for r in rows:
        if r["config"] != "cmr" or r["context_tokens"] == LIMIT_CONTEXT:
            continue
        b, n = r["batch_size"], r["context_tokens"]
        short = by_key.get(("cmr", b, LIMIT_CONTEXT))
        stock = by_key.get(("draft_model", b, n))
        if not short or not stock or r["mean_acceptance_length"] is None:
            continue
        step = r["verify_s_per_step"] + short["draft_s_per_step"] + (r["retrieval_s_per_step"] or 0)
        limit = tokens_per_step(r) / step
        limits.append({
            "batch_size": b, "context_tokens": n,
            "cmr_tok_s": r["output_tok_s"], "stock_tok_s": stock["output_tok_s"],
            "target_tok_s": by_key.get(("target", b, n), {}).get("output_tok_s"),
            "cmr_limit_tok_s": limit,
            "limit_vs_stock": limit / stock["output_tok_s"],
            "share_of_limit": r["output_tok_s"] / limit,
            "draft_s": r["draft_s_per_step"], "draft_s_at_working_cache": short["draft_s_per_step"],
            "verify_s": r["verify_s_per_step"],
        })
    return limits


def h100_projection(rows: list[dict], target: dict, draft: dict, k: int,
                    retrieval_interval: int) -> list[dict]:
    projections = []
    for r in rows:
        b, n, config = r["batch_size"], r["context_tokens"], r["config"]
        verify = (target["weight_bytes"] + b * n * target["kv_bytes_per_token"])
        step_bytes = verify
        acceptance = 1.0
        if config not in ("target", "target_sync"):
            acceptance = r["mean_acceptance_length"] or 1.0
            draft_context = n
            if config in ("cmr", "streaming") and r["kept_fraction"] is not None:
                draft_context = n * r["kept_fraction"]
            if config in ("cmr", "cmr_k_by_batch"):
                # Scoring reads the tapped keys of the context at each retrieval.
                step_bytes += b * n * target["last_layer_key_bytes_per_token"] / retrieval_interval
            passes = k
            if config == "cmr_k_by_batch":
                # vLLM's schedule; at K=0 the draft still runs once to fill its KV.
                passes = scheduled_k(b, k) or 1
            step_bytes += passes * (draft["weight_bytes"]
                                    + b * draft_context * draft["kv_bytes_per_token"])
        step_s = step_bytes / H100_SXM_BYTES_PER_S
        projections.append({"config": config, "batch_size": b, "context_tokens": n,
                            "acceptance_length": acceptance,
                            "tokens_per_step": tokens_per_step(r), "step_ms": 1e3 * step_s,
                            "tok_s": tokens_per_step(r) / step_s})
    return projections


def limits_table(limits: list[dict]) -> str:
    lines = ["| batch | context | target tok/s | stock tok/s | cmr tok/s | cmr limit tok/s | "
             "limit vs stock | cmr share of limit | cmr draft s/step | at working cache | "
             "verify s/step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in limits:
        lines.append(
            f"| {x['batch_size']} | {x['context_tokens']} | {fmt(x['target_tok_s'])} | "
            f"{x['stock_tok_s']:.2f} | {x['cmr_tok_s']:.2f} | {x['cmr_limit_tok_s']:.2f} | "
            f"{x['limit_vs_stock']:.2f}x | {100 * x['share_of_limit']:.0f}% | "
            f"{x['draft_s']:.3f} | {x['draft_s_at_working_cache']:.3f} | {x['verify_s']:.3f} |")
    return "\n".join(lines)


def projection_table(projections: list[dict]) -> str:
    lines = ["| config | batch | context | acceptance length | tokens per step | step ms | tok/s | "
             "vs draft_model |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    stock = {(p["batch_size"], p["context_tokens"]): p for p in projections
             if p["config"] == "draft_model"}
    for p in sorted(projections, key=lambda p: (p["context_tokens"], p["batch_size"])):
        ref = stock.get((p["batch_size"], p["context_tokens"]))
        lines.append(f"| {p['config']} | {p['batch_size']} | {p['context_tokens']} | "
                     f"{p['acceptance_length']:.2f} | {p['tokens_per_step']:.2f} | "
                     f"{p['step_ms']:.2f} | {p['tok_s']:.0f} | "
                     f"{fmt_ratio(p['tok_s'] / ref['tok_s'] if ref else None)} |")
    return "\n".join(lines)


def read_grid(folders: list[Path]) -> tuple[dict, list[dict]]:
    """The first folder's results and the rows of all of them, which must
    come from the same models, K, dtype, spec_extend options and CPU, each
    grid point measured once."""
    results = [json.loads((folder / "results.json").read_text()) for folder in folders]
    first = results[0]
    for folder, result in zip(folders[1:], results[1:]):
        for section, key in [("args", "target"), ("args", "draft"), ("args", "k"),
                             ("args", "dtype"), ("args", "spec_extend"),
                             ("machine", "cpu_model")]:
            if result[section].get(key) != first[section].get(key):
                raise SystemExit(f"{folder}: {key} {result[section].get(key)!r} differs from "
                                 f"{folders[0]}'s {first[section].get(key)!r}")
    rows = [row for result in results for row in result["measurements"]]
    keys = [(r["config"], r["batch_size"], r["context_tokens"]) for r in rows]
    if len(set(keys)) < len(keys):
        raise SystemExit(f"{', '.join(map(str, folders))}: a configuration, batch size and "
                         "context measured more than once")
    return first, rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, nargs="+", default=[RESULTS_DIR / "batch"],
                        help="results folders of one grid; the model goes into the first")
    args = parser.parse_args(argv)
    from benchmarks.real_models import resolve_model

    result, rows = read_grid(args.results)
    run_args = result["args"]
    out_dir = args.results[0]
    target = model_bytes(Path(resolve_model(run_args["target"])))
    draft = model_bytes(Path(resolve_model(run_args["draft"])))
    limits = cpu_limits(rows)
    spec_extend = json.loads(run_args.get("spec_extend") or "{}")
    projections = h100_projection(rows, target, draft, run_args["k"],
                                  spec_extend.get("retrieval_interval", 4))
    (out_dir / "cost_model.json").write_text(json.dumps(
        {"target": target, "draft": draft, "h100_bytes_per_s": H100_SXM_BYTES_PER_S,
         "cpu_limits": limits, "h100_projection": projections}, indent=2))
    text = (
        "# Step-cost model\n\n"
        f"From {', '.join(f'`{folder.name}/results.json`' for folder in args.results)} "
        f"({result['machine'].get('cpu_model', result['machine']['processor'])}, "
        f"{result['machine']['cpu_count']} cores). Weights: target "
        f"{target['weight_bytes'] / 1e9:.2f} GB, draft {draft['weight_bytes'] / 1e9:.2f} GB; "
        f"KV per token: target {target['kv_bytes_per_token']} B, draft "
        f"{draft['kv_bytes_per_token']} B.\n\n"
        "## CPU limit of cmr (measured components)\n\n"
        f"cmr with its draft step at the cost measured at {LIMIT_CONTEXT} context (about its "
        f"{WORKING_CACHE_TOKENS}-token working cache), its own verification, retrieval and "
        "tokens per step (decode tokens over decode steps; batch x acceptance would overstate "
        "them, since a batch runs until its slowest request is done).\n\n"
        f"{limits_table(limits) if limits else NO_LIMIT_ROWS}\n\n"
        "## H100 SXM roofline projection (not a measurement)\n\n"
        "Step time = bytes read / 3.35 TB/s: target weights + batch x context x target KV, "
        "plus K draft passes (for cmr_k_by_batch the K of vLLM's schedule, one pass where it "
        "is 0) of draft weights + batch x (context, or the kept tokens for "
        "cmr / streaming) x draft KV, plus for cmr the scoring's read of the tapped last-layer "
        "keys every `retrieval_interval` steps. Tokens per step are the ones measured on "
        "CPU.\n\n"
        f"{projection_table(projections)}\n"
    )
    (out_dir / "cost_model.md").write_text(text)
    plot_by_batch_size(
        [p | {"value": p["tok_s"]} for p in projections], out_dir / "cost_model.png",
        "Roofline projection to one H100 SXM from measured tokens per step (not measured)",
        "projected output tokens/s", linestyle="--",
    )
    print(text)


if __name__ == "__main__":
    main()
