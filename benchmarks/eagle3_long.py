"""A short-window EAGLE-3 head on long inputs (the SpecExtend paper's Table 6,
in vLLM): acceptance per draft position and decode speed from 1K to 16K.

    python -m benchmarks --eagle3 [--draft HEAD] [--lengths 1024 4096 8192 16384]
                                  [--batch-sizes 1 4] [--max-batch-tokens 32768]

The head is the one ``scripts/make_eagle_head.sh`` trains (sequences of at
most 1024 tokens; ``--draft`` takes another). Passages come from the novel the
head's training held out. Configurations, back to back on one machine:

- ``target``: the target alone.
- ``eagle3_full``: stock EAGLE-3 with the head's window raised to the
  engine's ``max_model_len``, i.e. full attention at positions it never saw
  in training (what users run today: vLLM's V1 runner would otherwise stop
  drafting for the whole batch past the window).
- ``eagle3_sliding``: stock EAGLE-3, the head's attention a sliding window
  of its training window (speculators' default kind of head; the public
  fix), window raised likewise.
- ``cmr``, ``streaming``: the head as trained, with SpecExtend: requests past
  its window draft from their working cache at compact positions (the same
  budget for both); ``goodput``: cmr with goodput control.

The stock variants are the same weights with an edited ``config.json``
(``head_variant``). Engines use prefix caching and prefill every passage once,
untimed, so runs are decode only (``benchmarks/batch.py``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.batch import (
    PASSAGE_STRIDE,
    BatchMeasurement,
    all_engine_runs,
    engine_spec_extend,
    mark_same_as_target,
    paused_percent,
    rounds_cell,
    vs_target,
)
from benchmarks.corpus import load_corpus
from benchmarks.machine import machine_info
from benchmarks.prompts import summarization_prompt
from benchmarks.report import args_record, config_color, fmt, fmt_ratio, pyplot, save_figure
from benchmarks.runs import engine_max_model_len

EAGLE3_CONFIGS = ("target", "eagle3_full", "eagle3_sliding", "cmr", "streaming", "goodput")
STOCK_VARIANTS = ("eagle3_full", "eagle3_sliding")
OURS = ("cmr", "streaming", "goodput")


def head_window(head: Path) -> int:
    """The head's ``max_position_embeddings`` (speculators or plain config)."""
    config = json.loads((head / "config.json").read_text())
    return config.get("transformer_layer_config", config)["max_position_embeddings"]


def head_variant(head: Path, name: str, overrides: dict[str, Any]) -> Path:
    """The head's weights under a config with ``overrides`` applied to its
    layer config (``transformer_layer_config`` in speculators' format), in
    ``<head>.variants/<name>`` (files other than config.json are symlinks)."""
    out = head.with_name(head.name + ".variants") / name
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((head / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    layer.update(overrides)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for item in head.iterdir():
        link = out / item.name
        if item.name != "config.json" and item.is_file() and not link.exists():
            link.symlink_to(item.resolve())
    return out


def stock_heads(head: Path, max_model_len: int) -> dict[str, Path]:
    window = head_window(head)
    raised = {"max_position_embeddings": max_model_len}
    return {
        "eagle3_full": head_variant(head, f"full-{max_model_len}", raised),
        "eagle3_sliding": head_variant(
            head, f"sliding-{window}-{max_model_len}",
            raised | {"layer_types": ["sliding_attention"], "sliding_window": window,
                      "use_sliding_window": True}),
    }


def grid_points(batch_sizes: list[int], lengths: list[int],
                max_batch_tokens: int | None) -> list[tuple[int, int]]:
    """(batch size, length) points: those within ``max_batch_tokens`` prompt
    tokens per batch, and the smallest batch at every length."""
    smallest = min(batch_sizes)
    return [(b, n) for n in lengths for b in sorted(batch_sizes)
            if b == smallest or max_batch_tokens is None or b * n <= max_batch_tokens]


def run_eagle3(args) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    head = Path(args.draft)
    if not (head / "config.json").is_file():
        raise SystemExit(f"no EAGLE-3 head in {head}: make it with scripts/make_eagle_head.sh "
                         "(~75 min on a 2-core AMX machine) or pass --draft HEAD")
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    text = load_corpus(args.corpus)
    points = grid_points(args.batch_sizes, args.lengths, args.max_batch_tokens)
    prompts = {
        length: [summarization_prompt(tokenizer, text, length,
                                      offset=args.offset + i * PASSAGE_STRIDE)
                 for i in range(max(b for b, n in points if n == length))]
        for length in args.lengths
    }
    # The stock heads' window raised to the engines' max_model_len.
    variants = stock_heads(head, engine_max_model_len(args))
    unknown = [c for c in args.configs if c not in EAGLE3_CONFIGS]
    if unknown:
        raise SystemExit(f"--eagle3: unknown configuration(s) {unknown}; choose from "
                         f"{list(EAGLE3_CONFIGS)}")
    configs = list(args.configs)
    # Ours first: an option the engine refuses fails the run in its first minute.
    ours = [c for c in OURS if c in configs]
    engines: list[tuple[str, list[str], Path]] = [("cmr", ours, head)] if ours else []
    if "target" in configs:
        engines.append(("target", ["target"], head))
    engines += [(c, [c], variants[c]) for c in STOCK_VARIANTS if c in configs]
    total = len(configs) * len(points)
    opened = [(engine_config, engine_configs,
               engine_spec_extend(args, engine_config, engine_configs)
               if engine_config == "cmr" else None,
               argparse.Namespace(**{**vars(args), "draft": str(draft)}))
              for engine_config, engine_configs, draft in engines]
    with tqdm(total=total, desc="eagle3 benchmark", unit="run") as progress:
        measurements, token_ids = all_engine_runs(args, opened, prompts, progress)
    mark_same_as_target(measurements, token_ids)
    head_report = head / "eagle_head.json"
    return {
        "machine": machine_info(),
        "args": args_record(args),
        "head": str(head),
        "head_window": head_window(head),
        "head_variants": {k: str(v) for k, v in variants.items()},
        "head_recipe": (json.loads(head_report.read_text()) if head_report.is_file()
                        else None),
        "measurements": [asdict(m) for m in measurements],
        "_objects": measurements,
    }


def bars(measurements: list[BatchMeasurement]) -> list[str]:
    """The issue's bars, read off the measurements (batch 1 where it says so)."""
    by_key = {(m.config, m.batch_size, m.context_tokens): m for m in measurements}

    def acc(config, batch, length):
        m = by_key.get((config, batch, length))
        return m.mean_acceptance_length if m else None

    lines = []
    lengths = sorted({m.context_tokens for m in measurements})
    for batch in sorted({m.batch_size for m in measurements}):
        for length in lengths:
            cmr, full, sliding = (acc(c, batch, length)
                                  for c in ("cmr", "eagle3_full", "eagle3_sliding"))
            if cmr and full and sliding:
                lines.append(
                    f"- batch {batch}, {length}: cmr acceptance {cmr:.2f} = "
                    f"{cmr / full:.2f}x stock full attention ({full:.2f}), "
                    f"{cmr / sliding:.2f}x sliding window ({sliding:.2f})")
        first = lengths[0]
        own = acc("eagle3_full", batch, first)
        for length in lengths:
            cmr = acc("cmr", batch, length)
            if own and cmr:
                lines.append(f"- batch {batch}: cmr at {length} keeps {cmr / own:.2f}x the "
                             f"head's own acceptance at {first} ({own:.2f})")
        for length in lengths:
            target = by_key.get(("target", batch, length))
            ours = [by_key[(c, batch, length)] for c in OURS if (c, batch, length) in by_key]
            if target and ours:
                best = max(ours, key=lambda m: vs_target(m, target))
                paired = " (paired by round)" if best.paired_vs_target is not None else ""
                lines.append(
                    f"- batch {batch}, {length}: best of ours {best.config} "
                    f"{best.output_tok_s:.2f} tok/s = "
                    f"{vs_target(best, target):.2f}x the target alone{paired} "
                    f"({target.output_tok_s:.2f})")
    return lines


def eagle3_table(measurements: list[BatchMeasurement]) -> str:
    width = max((len(m.acceptance_per_position or []) for m in measurements), default=0)
    lines = [
        "| batch | context | config | output tok/s | vs target | acc. len | "
        + "".join(f"acc. pos {i + 1} | " for i in range(width))
        + "draft s/step | verify s/step | kept % | paused % | same as target | rounds tok/s |",
        "|---:|---:|---|---:|---:|---:|" + "---:|" * width + "---:|---:|---:|---:|---|---|",
    ]
    by_key = {(m.config, m.batch_size, m.context_tokens): m for m in measurements}
    order = {c: i for i, c in enumerate(EAGLE3_CONFIGS)}
    for m in sorted(measurements, key=lambda m: (m.batch_size, m.context_tokens,
                                                 order.get(m.config, 99))):
        target = by_key.get(("target", m.batch_size, m.context_tokens))
        positions = m.acceptance_per_position or []
        cells = [fmt(p) for p in positions] + ["-"] * (width - len(positions))
        same = "-" if m.same_as_target is None else ("yes" if m.same_as_target else "NO")
        lines.append(
            f"| {m.batch_size} | {m.context_tokens} | {m.config} | {m.output_tok_s:.2f} | "
            f"{fmt_ratio(vs_target(m, target))} | "
            f"{fmt(m.mean_acceptance_length)} | " + "".join(f"{c} | " for c in cells)
            + f"{fmt(m.draft_s_per_step, '.3f')} | {fmt(m.verify_s_per_step, '.3f')} | "
            f"{fmt(None if m.kept_fraction is None else 100 * m.kept_fraction, '.1f')} | "
            f"{fmt(paused_percent(m.control), '.0f')} | {same} | {rounds_cell(m)} |")
    return "\n".join(lines)


def plot_eagle3(measurements: list[BatchMeasurement], path: Path, title: str) -> None:
    """Per batch size: acceptance length and decode tok/s against context
    length; the last panel, acceptance per draft position at the longest
    context (batch 1)."""
    plt = pyplot()
    batches = sorted({m.batch_size for m in measurements})
    fig, axes = plt.subplots(1, 2 * len(batches) + 1, figsize=(4.6 * (2 * len(batches) + 1), 4.2))
    configs = [c for c in EAGLE3_CONFIGS if any(m.config == c for m in measurements)]
    for i, batch in enumerate(batches):
        ax_acc, ax_speed = axes[2 * i], axes[2 * i + 1]
        for config in configs:
            rows = sorted((m for m in measurements
                           if m.config == config and m.batch_size == batch),
                          key=lambda m: m.context_tokens)
            xs = [m.context_tokens for m in rows]
            kwargs = dict(marker="o", label=config, color=config_color(config))
            if config != "target":
                ax_acc.plot(xs, [m.mean_acceptance_length for m in rows], **kwargs)
            ax_speed.plot(xs, [m.output_tok_s for m in rows], **kwargs)
        for ax, label in ((ax_acc, "acceptance length"), (ax_speed, "output tokens/s")):
            ax.set_title(f"batch {batch}")
            ax.set_xscale("log", base=2)
            lengths = sorted({m.context_tokens for m in measurements})
            ax.set_xticks(lengths, [str(n) for n in lengths])
            ax.set_xlabel("context tokens")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    ax = axes[-1]
    batch = batches[0]
    longest = max(m.context_tokens for m in measurements)
    for config in configs:
        m = next((m for m in measurements if m.config == config and m.batch_size == batch
                  and m.context_tokens == longest), None)
        if m and m.acceptance_per_position:
            ax.plot(range(1, len(m.acceptance_per_position) + 1), m.acceptance_per_position,
                    marker="o", label=config, color=config_color(config))
    ax.set_title(f"batch {batch}, {longest} tokens")
    ax.set_xlabel("draft position")
    ax.set_xticks(range(1, 1 + max((len(m.acceptance_per_position or [])
                                    for m in measurements), default=1)))
    ax.set_ylabel("share of drafts accepted up to it")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path, title)


def write_eagle3(result: dict[str, Any], out_dir: Path, title: str) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    measurements = result.pop("_objects")
    table = eagle3_table(measurements)
    summary = "\n".join(bars(measurements))
    (out_dir / "eagle3.json").write_text(json.dumps(result, indent=2))
    (out_dir / "eagle3.md").write_text(
        f"# {title}\n\nHead: `{result['head']}` (window {result['head_window']}). One "
        "`LLM.generate` call per row: the first `batch` passages of the length, prefilled "
        "once per engine (prefix cache), decode-only timings. `acc. pos i`: share of drafts "
        f"accepted up to draft position i.\n\n{table}\n\n## Bars\n\n{summary}\n")
    plot_eagle3(measurements, out_dir / "eagle3.png", title)
    return f"{table}\n\n{summary}"
