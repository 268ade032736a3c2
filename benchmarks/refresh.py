"""Retrieval refresh on acceptance drops against the fixed interval: draft
acceptance and retrievals per verification, on a needle with a long answer
(repeat a made-up sentence hidden at some depth) and on documents whose topic
changes mid-generation (copy one paragraph, then another far from it).

    python -m benchmarks --refresh [--refresh-length 4096]

One cmr engine with prefix caching; each configuration is switched in with
``reconfigure`` and serves every case alone (batch 1, greedy).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.corpus import load_corpus
from benchmarks.machine import machine_info
from benchmarks.needle import NEEDLE_DEPTHS
from benchmarks.prompts import secret_sentence, secret_sentence_prompt, two_passages_prompt
from benchmarks.report import config_color, pyplot, save_figure
from benchmarks.runs import engine_kwargs, started_engine
from benchmarks.worker_hooks import reconfigure_drafter, retrieval_refreshes, spec_counters

REFRESH_CONFIGS = {
    "cmr": {},  # every 4 steps, the default
    "cmr_every_16": {"retrieval_interval": 16},
    "cmr_on_drops": {"retrieval_refresh": "acceptance", "retrieval_interval": 16},
}
TWO_PASSAGE_OFFSETS = (100_000, 300_000, 500_000, 700_000)


def refresh_cases(args, tokenizer) -> list[dict[str, Any]]:
    import random

    text = load_corpus(args.corpus)
    rng = random.Random(0)
    cases = []
    for depth in NEEDLE_DEPTHS:
        sentence = secret_sentence(rng)
        cases.append({"kind": "needle", "case": f"depth {depth:.0%}", "needle": sentence,
                      "max_tokens": args.refresh_tokens,
                      "ids": secret_sentence_prompt(tokenizer, text[args.offset:],
                                                    args.refresh_length, depth, sentence)})
    for offset in TWO_PASSAGE_OFFSETS:
        cases.append({"kind": "two passages", "case": f"offset {offset}",
                      "max_tokens": args.refresh_tokens,
                      "ids": two_passages_prompt(tokenizer, text[offset:], args.refresh_length)})
    return cases


def run_refresh(args) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    cases = refresh_cases(args, tokenizer)
    base = json.loads(args.spec_extend) if args.spec_extend else {}
    longest = max(len(c["ids"]) + c["max_tokens"] for c in cases)
    with started_engine(**engine_kwargs(args, "cmr", {**base, **REFRESH_CONFIGS["cmr"]})
                        | {"max_model_len": longest + 64, "enable_prefix_caching": True}) as llm:
        rows = []
        with tqdm(total=len(REFRESH_CONFIGS) * len(cases), desc="refresh", unit="run") as bar:
            for name, options in REFRESH_CONFIGS.items():
                llm.collective_rpc(reconfigure_drafter, args=({**base, **options},))
                for case in cases:
                    before = spec_counters(llm), llm.collective_rpc(retrieval_refreshes)[0]
                    params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"])
                    output = llm.generate([TokensPrompt(prompt_token_ids=case["ids"])], params,
                                          use_tqdm=False)[0].outputs[0]
                    rows.append(_row(name, case, output, before,
                                     (spec_counters(llm),
                                      llm.collective_rpc(retrieval_refreshes)[0])))
                    bar.update(1)
    return {"machine": machine_info(), "context_tokens": args.refresh_length,
            "configs": REFRESH_CONFIGS, "rows": rows}


def _row(name, case, output, before, after) -> dict[str, Any]:
    def delta(key):
        return after[0][f"vllm:spec_decode_{key}"] - before[0][f"vllm:spec_decode_{key}"]

    refreshes = {cause: after[1][cause] - before[1][cause] for cause in after[1]}
    return {
        "config": name, "kind": case["kind"], "case": case["case"],
        "prompt_tokens": len(case["ids"]), "output_token_ids": list(output.token_ids),
        "needle_repeated": case["needle"] in output.text if "needle" in case else None,
        "verifications": delta("num_drafts"),
        "draft_acceptance": (delta("num_accepted_tokens") / delta("num_draft_tokens")
                             if delta("num_draft_tokens") else None),
        "mean_acceptance_length": (1 + delta("num_accepted_tokens") / delta("num_drafts")
                                   if delta("num_drafts") else None),
        "refreshes": refreshes,
    }


def refresh_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind and configuration: acceptance over all drafts and retrievals
    after the first per 100 verifications."""
    summary = []
    first = {(r["kind"], r["case"]): r["output_token_ids"] for r in rows if r["config"] == "cmr"}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        for config in dict.fromkeys(r["config"] for r in rows):
            mine = [r for r in rows if r["kind"] == kind and r["config"] == config]
            verifications = sum(r["verifications"] for r in mine)
            lengths = [r["mean_acceptance_length"] * r["verifications"] for r in mine
                       if r["mean_acceptance_length"]]
            later = {c: sum(r["refreshes"][c] for r in mine) for c in ("interval", "acceptance")}
            summary.append({
                "kind": kind, "config": config, "cases": len(mine),
                "verifications": verifications,
                "mean_acceptance_length": sum(lengths) / verifications if verifications else None,
                "refreshes_per_100": 100 * sum(later.values()) / verifications
                if verifications else None,
                "refreshes": later,
                "same_tokens_as_cmr": all(r["output_token_ids"] == first[(kind, r["case"])]
                                          for r in mine),
                "needle_repeated": (sum(r["needle_repeated"] for r in mine)
                                    if kind == "needle" else None),
            })
    return summary


def refresh_table(summary: list[dict[str, Any]]) -> str:
    lines = ["| text | config | cases | verifications | acceptance length | "
             "refreshes / 100 verifications (interval + on drops) | same tokens as cmr | "
             "needle repeated by the target |",
             "|---|---|---:|---:|---:|---:|---|---:|"]
    for s in summary:
        repeated = "-" if s["needle_repeated"] is None else f"{s['needle_repeated']}/{s['cases']}"
        lines.append(
            f"| {s['kind']} | {s['config']} | {s['cases']} | {s['verifications']:.0f} | "
            f"{s['mean_acceptance_length']:.2f} | {s['refreshes_per_100']:.1f} "
            f"({s['refreshes']['interval']} + {s['refreshes']['acceptance']}) | "
            f"{'yes' if s['same_tokens_as_cmr'] else 'NO'} | {repeated} |")
    return "\n".join(lines)


def write_refresh(result: dict[str, Any], out_dir: Path, title: str) -> str:
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = refresh_summary(result["rows"])
    result = {**result, "summary": summary}
    table = refresh_table(summary)
    (out_dir / "refresh.json").write_text(json.dumps(result, indent=2))
    (out_dir / "refresh.md").write_text(
        f"# Retrieval refresh, {result['context_tokens']}-token contexts\n\n{title}\n\n"
        f"{table}\n")
    kinds = list(dict.fromkeys(s["kind"] for s in summary))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for s in (s for s in summary if s["kind"] == kind):
            ax.scatter(s["refreshes_per_100"], s["mean_acceptance_length"], s=80,
                       label=s["config"], color=config_color(s["config"]))
        ax.set_title(kind)
        ax.set_xlabel("retrievals after the first, per 100 verifications")
        ax.set_ylabel("acceptance length")
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, out_dir / "refresh.png", title)
    return table
