"""Option sweep of cmr: one engine, each prompt prefilled once, every option
point re-decoding it (the engine's drafter is reconfigured between runs).

    python -m benchmarks --sweep [--sweep-points JSON]
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.corpus import load_corpus
from benchmarks.machine import machine_info
from benchmarks.prompts import summarization_prompt
from benchmarks.runs import (
    Measurement,
    engine_kwargs,
    markdown_table,
    measurement_from,
    started_engine,
)
from benchmarks.worker_hooks import (
    install_timers,
    read_timers,
    reconfigure_drafter,
    spec_counters,
)

# Keeps every chunk: drafting identical to stock draft_model (tested), in the same engine.
FULL_CACHE_POINT = {"top_k_chunks": 100_000, "min_context_tokens": 0}
# The stock reference, then one option changed at a time from the defaults,
# then combinations that trade recent window for retrieved chunks at the same budget.
SWEEP_POINTS: tuple[dict[str, Any], ...] = (
    FULL_CACHE_POINT,
    {},
    {"top_k_chunks": 2}, {"top_k_chunks": 4}, {"top_k_chunks": 16},
    {"chunk_size": 256, "top_k_chunks": 4},
    {"recent_tokens": 128}, {"recent_tokens": 512},
    {"retrieval_interval": 1}, {"retrieval_interval": 8},
    {"score_aggregation": "accepted_tokens"},
    {"mode": "streaming"},
    {"top_k_chunks": 5, "recent_tokens": 128},
    {"top_k_chunks": 5, "recent_tokens": 128, "score_aggregation": "accepted_tokens"},
    {"top_k_chunks": 4, "score_aggregation": "accepted_tokens", "retrieval_interval": 2},
)


def run_sweep(args) -> dict[str, Any]:
    """One cmr engine with prefix caching: each prompt is prefilled once, then
    every option point re-decodes it, so a point costs only its decode."""
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    text = load_corpus(args.corpus)
    prompts = {n: summarization_prompt(tokenizer, text, n, offset=args.offset)
               for n in args.lengths}
    base = json.loads(args.spec_extend) if args.spec_extend else {}
    points = json.loads(args.sweep_points) if args.sweep_points else SWEEP_POINTS
    with started_engine(**engine_kwargs(args, "cmr", {**base, "mode": "cmr"})
                        | {"enable_prefix_caching": True}) as llm:
        measurements: list[Measurement] = []
        llm.collective_rpc(install_timers)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for ids in prompts.values():  # prefill once; later runs hit the cache
            llm.generate([TokensPrompt(prompt_token_ids=ids)],
                         SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        with tqdm(total=len(points) * len(prompts), desc="sweep", unit="run") as bar:
            for point in points:
                options = {**base, "mode": "cmr", **point}
                label = ("draft_model" if point == FULL_CACHE_POINT
                         else ", ".join(f"{k}={v}" for k, v in point.items()) or "defaults")
                llm.collective_rpc(reconfigure_drafter, args=(options,))
                for length, ids in prompts.items():
                    c0, t0 = spec_counters(llm), llm.collective_rpc(read_timers)[0]
                    output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params,
                                          use_tqdm=False)[0]
                    c1, t1 = spec_counters(llm), llm.collective_rpc(read_timers)[0]
                    measurements.append(measurement_from(label, length, output, c0, c1, t0, t1))
                    bar.update(1)
    return {
        "machine": machine_info(),
        "base_options": base,
        "points": list(points),
        "measurements": [asdict(m) for m in measurements],
        "_objects": measurements,
    }


def write_sweep(result: dict[str, Any], out_dir: Path, title: str) -> str:
    objects = result.pop("_objects")
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(objects)
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=2))
    (out_dir / "sweep.md").write_text(
        f"# Option sweep (cmr)\n\n{title}; one engine with prefix caching "
        "(each prompt prefilled once), options swapped between runs. Each row applies "
        f"its options on top of the package defaults (and `--spec-extend` "
        f"{json.dumps(result['base_options'])}); the `draft_model` row is cmr keeping "
        "every chunk, whose drafting is identical to stock draft_model (tested).\n\n"
        f"{table}\n")
    return table
