"""Goodput control's choices over time: the drafts K_r each request of one
batch gets at every engine step, for requests of different lengths.

    python -m benchmarks --k-trace [--lengths 1024 2048 4096 8192] [--max-tokens 128]

One engine (cmr with ``speculation_control: goodput``) serves the batch
twice: first with a controller that has learnt nothing (``cold``), then
with what it learnt (``warm``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.batch import PASSAGE_STRIDE
from benchmarks.corpus import load_corpus
from benchmarks.machine import machine_info
from benchmarks.prompts import summarization_prompt
from benchmarks.report import pyplot, save_figure
from benchmarks.runs import engine_kwargs, started_engine
from benchmarks.worker_hooks import read_control_trace, start_control_trace

PASSES = ("cold", "warm")


def run_k_trace(args) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    text = load_corpus(args.corpus)
    prompts = [summarization_prompt(tokenizer, text, length, args.offset + i * PASSAGE_STRIDE)
               for i, length in enumerate(args.lengths)]
    base = json.loads(args.spec_extend) if args.spec_extend else {}
    with started_engine(**engine_kwargs(args, "goodput", {**base, "speculation_control": "goodput"})
                        | {"max_num_seqs": len(prompts)}) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        passes = {}
        for name in PASSES:
            llm.collective_rpc(start_control_trace)
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
            # vLLM numbers requests in submission order: map ids to lengths.
            lengths = {o.request_id: len(o.prompt_token_ids) for o in outputs}
            passes[name] = _per_request(llm.collective_rpc(read_control_trace)[0], lengths)
    return {"machine": machine_info(), "k": args.k, "passes": passes}


def _per_request(trace: list[dict], lengths: dict[str, int]) -> list[dict[str, Any]]:
    """Per request (by prompt length): the engine step, context length and
    drafts chosen at each step it decoded in."""
    requests: dict[str, dict[str, Any]] = {}
    for step, plan in enumerate(trace):
        for req_id, context, k in zip(plan["req_ids"], plan["context_lens"],
                                      plan["draft_lengths"]):
            prompt = next((n for rid, n in lengths.items()
                           if req_id == rid or req_id.startswith(f"{rid}-")), None)
            if prompt is None or context < prompt:
                continue  # prefilling
            row = requests.setdefault(req_id, {"prompt_tokens": prompt, "steps": [],
                                               "context_lens": [], "draft_lengths": []})
            row["steps"].append(step)
            row["context_lens"].append(context)
            row["draft_lengths"].append(k)
    return sorted(requests.values(), key=lambda r: r["prompt_tokens"])


def k_trace_table(passes: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| pass | prompt tokens | decode steps | steps drafted | mean K when drafting |",
             "|---|---:|---:|---:|---:|"]
    for name, requests in passes.items():
        for r in requests:
            drafted = [k for k in r["draft_lengths"] if k]
            mean_k = f"{sum(drafted) / len(drafted):.2f}" if drafted else "-"
            lines.append(f"| {name} | {r['prompt_tokens']} | {len(r['steps'])} | "
                         f"{len(drafted)} | {mean_k} |")
    return "\n".join(lines)


def write_k_trace(result: dict[str, Any], out_dir: Path, title: str) -> str:
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    table = k_trace_table(result["passes"])
    (out_dir / "k_trace.json").write_text(json.dumps(result, indent=2))
    (out_dir / "k_trace.md").write_text(f"# Drafts chosen per step (goodput control)\n\n"
                                        f"{title}\n\n{table}\n")
    passes = result["passes"]
    fig, axes = plt.subplots(len(passes), 1, figsize=(10, 2.6 * len(passes)), squeeze=False,
                             sharex=True)
    colors = plt.get_cmap("viridis")
    for ax, (name, requests) in zip(axes[:, 0], passes.items()):
        for i, r in enumerate(requests):
            # Offset each request's line a little so equal choices stay visible.
            ks = [k + 0.06 * (i - (len(requests) - 1) / 2) for k in r["draft_lengths"]]
            ax.step(r["steps"], ks, where="post", label=f"{r['prompt_tokens']} tokens",
                    color=colors(i / max(len(requests) - 1, 1)))
        ax.set_ylabel(f"{name}: drafts K_r")
        ax.set_yticks(range(result["k"] + 1))
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("engine step")
    save_figure(fig, out_dir / "k_trace.png", title)
    return table
