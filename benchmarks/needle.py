"""Needle retrieval: a pass key hidden at several depths of a long real-text
context; how much of the target's answer the draft proposes (draft acceptance
on the answer span) with the full draft cache, streaming and cmr.

    python -m benchmarks --needle [--needle-length 4096] [--configs cmr streaming]

``--configs`` picks among draft_model, streaming and cmr; with
``--draft-window`` the uncapped draft (draft_model_full) always runs too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.corpus import load_corpus
from benchmarks.machine import machine_info
from benchmarks.prompts import needle_prompt
from benchmarks.report import config_color, pyplot, save_figure
from benchmarks.runs import engine_kwargs, started_engine
from benchmarks.worker_hooks import spec_counters

NEEDLE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def run_needle(args) -> dict[str, Any]:
    """Draft acceptance on the answer span with the full draft cache, streaming
    and cmr, next to the target's answer."""
    import random

    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    text = load_corpus(args.corpus)[args.offset:]
    rng = random.Random(0)
    cases = [(depth, str(rng.randrange(10_000, 99_999))) for depth in NEEDLE_DEPTHS]
    prompts = [needle_prompt(tokenizer, text, args.needle_length, d, key) for d, key in cases]
    base = json.loads(args.spec_extend) if args.spec_extend else {}
    configs = {name: spec_extend for name, spec_extend in (
        ("draft_model", None), ("streaming", {**base, "mode": "streaming"}),
        ("cmr", {**base, "mode": "cmr"})) if name in args.configs}
    if args.draft_window:
        # The uncapped draft: the reference the capped configurations are held to.
        configs = {"draft_model_full": None, **configs}
    params = SamplingParams(temperature=0.0, max_tokens=args.needle_tokens)
    rows = []
    with tqdm(total=len(configs) * len(cases), desc="needle", unit="run") as progress:
        for name, spec_extend in configs.items():
            max_model_len = args.needle_length + args.needle_tokens + 64
            with started_engine(**engine_kwargs(args, name, spec_extend)
                                | {"max_model_len": max_model_len}) as llm:
                for (depth, key), ids in zip(cases, prompts):
                    before = spec_counters(llm)
                    output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params,
                                          use_tqdm=False)[0]
                    after = spec_counters(llm)
                    drafted = (after["vllm:spec_decode_num_draft_tokens"]
                               - before["vllm:spec_decode_num_draft_tokens"])
                    accepted = (after["vllm:spec_decode_num_accepted_tokens"]
                                - before["vllm:spec_decode_num_accepted_tokens"])
                    answer = output.outputs[0].text
                    rows.append({"config": name, "depth": depth, "passkey": key,
                                 "answer": answer, "target_correct": key in answer,
                                 "drafted": drafted, "accepted": accepted,
                                 "draft_acceptance": accepted / drafted if drafted else None})
                    progress.update(1)
    return {"machine": machine_info(), "context_tokens": args.needle_length, "rows": rows}


def needle_table(rows: list[dict[str, Any]]) -> str:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    depths = sorted({r["depth"] for r in rows})
    lines = ["| config | " + " | ".join(f"depth {d:.0%}" for d in depths)
             + " | mean draft acceptance | target correct |",
             "|---|" + "---:|" * (len(depths) + 2)]
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        by_depth = {r["depth"]: r for r in mine}
        acceptance = [r["draft_acceptance"] or 0.0 for r in mine]
        lines.append(
            f"| {config} | "
            + " | ".join(f"{100 * (by_depth[d]['draft_acceptance'] or 0):.0f}%" for d in depths)
            + f" | {100 * sum(acceptance) / len(acceptance):.1f}% | "
            f"{sum(r['target_correct'] for r in mine)}/{len(mine)} |"
        )
    return "\n".join(lines)


def write_needle(result: dict[str, Any], out_dir: Path) -> str:
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    table = needle_table(rows)
    (out_dir / "needle.json").write_text(json.dumps(result, indent=2))
    (out_dir / "needle.md").write_text(
        f"# Needle retrieval, {result['context_tokens']} tokens: draft acceptance on the "
        f"answer span\n\n{table}\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = sorted((r for r in rows if r["config"] == config), key=lambda r: r["depth"])
        ax.plot([r["depth"] for r in mine], [r["draft_acceptance"] or 0 for r in mine],
                marker="o", label=config, color=config_color(config))
    ax.set_xlabel("needle depth")
    ax.set_ylabel("draft acceptance on the answer")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out_dir / "needle.png")
    return table
