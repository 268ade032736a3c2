"""Goodput control's floor inside vLLM on a CUDA GPU, with random weights.

Random weights (``load_format="dummy"``) make the worst case for speculation:
the draft's tokens are never accepted, so goodput control should learn to
pause and decode as fast as the target alone. An 8B-shaped target and a
1B-shaped draft_model (benchmarks.gpu_engine's shapes), bf16, K = 4, prefix
caching (each shape's prompts are prefilled once, then every timed call
decodes ``--max-tokens`` per request). One engine per configuration, each in
a process of its own, all with the same graph mode (FULL by default: goodput
control refuses FULL_DECODE_ONLY, whose graphs do not cover its paused steps)
and an in-process engine core:

- ``target``: the target alone with vLLM's defaults (model runner and
  scheduler as vLLM picks them: Model Runner V2 and the async scheduler on
  CUDA);
- ``target_v1``: the target alone in the V1 runner, vLLM's scheduler;
- ``target_sync``: the target alone in the V1 runner with the synchronous
  scheduler, which goodput control runs under;
- ``goodput``: cmr with ``speculation_control='goodput'``;
- ``always_paused``: the same engine forced never to draft (measured after
  ``goodput``'s rounds, in its process): the floor of a speculative engine.

    python -m benchmarks.gpu_floor --out benchmarks/results/gpu-goodput-floor \\
        --shapes 1x8192 8x4096 32x2048

Through the stand-in for vLLM's compiled ops:
``bash tests/gpu/standin/run.sh python3 -m benchmarks.gpu_floor ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_engine import GRAPHS, LLAMA_3_2_1B, LLAMA_3_8B, K, write_config
from benchmarks.report import (
    args_record,
    config_color,
    fmt,
    fmt_ratio,
    git_commit,
    pyplot,
    record_run,
    save_figure,
)

CONFIGS = ("target", "target_v1", "target_sync", "goodput")
REPORTED = ("target", "target_v1", "target_sync", "goodput", "always_paused")
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64)
"""``--tiny``: a smoke test of the harness on any machine (CPU included)."""


def engine_kwargs(config: str, models: Path, shapes: list[tuple[int, int]], graphs: str,
                  max_tokens: int, tiny: bool) -> dict:
    target = write_config(models / "target", TINY if tiny else LLAMA_3_8B)
    draft = write_config(models / "draft", TINY if tiny else LLAMA_3_2_1B)
    compilation = {"cudagraph_mode": GRAPHS[graphs], "mode": 0}
    kwargs = dict(model=str(target), load_format="dummy", dtype="bfloat16",
                  skip_tokenizer_init=True,
                  max_model_len=max(c for _, c in shapes) + max_tokens + 64,
                  max_num_seqs=max(b for b, _ in shapes), gpu_memory_utilization=0.6,
                  enable_prefix_caching=True, enforce_eager=graphs == "eager",
                  compilation_config=compilation, disable_log_stats=False, seed=0)
    if tiny:
        kwargs["kv_cache_memory_bytes"] = 512 << 20
    spec: dict | None = None
    if config == "goodput":
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
        kwargs["additional_config"] = {"spec_extend": {"speculation_control": "goodput"}}
    if config == "target_sync":
        kwargs["async_scheduling"] = False
    if os.environ.get("SPECEXTEND_GPU_STANDIN") == "1":
        compilation["custom_ops"] = ["none"]
        kwargs["attention_backend"] = "TRITON_ATTN"
        if spec is not None:  # vLLM picks the draft's backend on its own unless told
            spec["attention_backend"] = "TRITON_ATTN"
    if spec is not None:
        kwargs["speculative_config"] = spec
    return kwargs


def timed_rounds(llm, prompts, rounds: int, max_tokens: int, controlled: bool) -> list[dict]:
    from vllm import SamplingParams

    from benchmarks.worker_hooks import control_counts, spec_counters

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    records = []
    for _ in range(rounds):
        c0 = spec_counters(llm)
        k0 = llm.collective_rpc(control_counts)[0] if controlled else None
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        c1 = spec_counters(llm)
        k1 = llm.collective_rpc(control_counts)[0] if controlled else None
        record = {"seconds": seconds, "tok_s": len(prompts) * max_tokens / seconds,
                  "drafted_tokens": c1.get("vllm:spec_decode_num_draft_tokens", 0)
                  - c0.get("vllm:spec_decode_num_draft_tokens", 0),
                  "accepted_tokens": c1.get("vllm:spec_decode_num_accepted_tokens", 0)
                  - c0.get("vllm:spec_decode_num_accepted_tokens", 0)}
        if controlled:
            record["control"] = {key: k1[key] - k0[key] for key in k1
                                 if isinstance(k1[key], int)}
        records.append(record)
    return records


def run_one(config: str, shapes: list[tuple[int, int]], graphs: str, rounds: int,
            max_tokens: int, tiny: bool, out: Path) -> None:
    """One engine; every shape's rounds (and, for goodput, always_paused's)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if config != "target":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    import numpy as np

    from vllm import LLM, SamplingParams, TokensPrompt

    from benchmarks.worker_hooks import force_pause

    models = Path(tempfile.mkdtemp(prefix="gpu-floor-"))
    started = time.time()
    llm = LLM(**engine_kwargs(config, models, shapes, graphs, max_tokens, tiny))
    vllm_config = llm.llm_engine.vllm_config
    record = {"config": config, "graphs": graphs, "engine_start_s": time.time() - started,
              "async_scheduling": bool(vllm_config.scheduler_config.async_scheduling),
              "model_runner_v2": bool(getattr(vllm_config, "use_v2_model_runner", False)),
              "shapes": {}}
    for batch, context in shapes:
        rng = np.random.default_rng(context * 1000 + batch)
        prompts = [TokensPrompt(prompt_token_ids=rng.integers(1000, 30000 if tiny else 100000,
                                                              context).tolist())
                   for _ in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # prefix cache
        shape = f"{batch}x{context}"
        record["shapes"][shape] = {config: timed_rounds(llm, prompts, rounds, max_tokens,
                                                        config == "goodput")}
        if config == "goodput":
            llm.collective_rpc(force_pause, args=(True,))
            record["shapes"][shape]["always_paused"] = timed_rounds(
                llm, prompts, rounds, max_tokens, True)
            llm.collective_rpc(force_pause, args=(False,))
        print(f"[gpu_floor] {config} {shape}: "
              f"{[round(r['tok_s'], 1) for r in record['shapes'][shape][config]]} tok/s",
              flush=True)
    out.write_text(json.dumps(record))


def steady(rounds: list[dict]) -> float:
    """Median decode tok/s of the rounds after the first (which carries the
    controller's warm-up and the first graphs' replays)."""
    import numpy as np

    later = rounds[1:] or rounds
    return float(np.median([r["tok_s"] for r in later]))


def write_tables(records: list[dict], out_dir: Path) -> None:
    """results.json, results.md and results.png of ``records`` (one per engine)."""
    (out_dir / "results.json").write_text(json.dumps(records, indent=1))
    by_config = {}
    for record in records:
        for shape, configs in record.get("shapes", {}).items():
            for config, rounds in configs.items():
                by_config[(shape, config)] = rounds
    shapes = sorted({shape for shape, _ in by_config}, key=lambda s: tuple(map(int, s.split("x"))))
    lines = ["| batch x context | configuration | decode tok/s (first round) | "
             "decode tok/s (median of later rounds) | vs target | vs target_sync | "
             "drafted / accepted tokens (later rounds) |", "|---|---|---:|---:|---:|---:|---|"]
    for shape in shapes:
        base = by_config.get((shape, "target"))
        sync = by_config.get((shape, "target_sync"))
        for config in REPORTED:
            rounds = by_config.get((shape, config))
            if rounds is None:
                continue
            later = rounds[1:] or rounds
            lines.append(
                f"| {shape} | {config} | {fmt(rounds[0]['tok_s'], '.1f')} | "
                f"{fmt(steady(rounds), '.1f')} | "
                f"{fmt_ratio(steady(rounds) / steady(base) if base else None, '.3f')} | "
                f"{fmt_ratio(steady(rounds) / steady(sync) if sync else None, '.3f')} | "
                f"{sum(r['drafted_tokens'] for r in later):.0f} / "
                f"{sum(r['accepted_tokens'] for r in later):.0f} |")
    failed = [r for r in records if "error" in r]
    lines += [f"\n{r['config']}: failed: {r['error'][:200]}" for r in failed]
    engines = [f"- {r['config']}: async scheduling {r['async_scheduling']}, Model Runner V2 "
               f"{r['model_runner_v2']}, engine start {r['engine_start_s']:.0f} s"
               for r in records if "error" not in r]
    (out_dir / "results.md").write_text("\n".join(lines + [""] + engines) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(REPORTED)
    for i, config in enumerate(REPORTED):
        values = [steady(by_config[(s, config)]) / steady(by_config[(s, "target")])
                  if (s, config) in by_config and (s, "target") in by_config else 0
                  for s in shapes]
        ax.bar([j + width * i for j in range(len(shapes))], values, width=width, label=config,
               color=config_color(config))
    ax.axhline(0.97, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
    ax.set_ylabel("decode tok/s vs the target alone")
    ax.legend(fontsize=8)
    save_figure(fig, out_dir / "results.png", "Goodput control's floor on a GPU, random weights")


def write_report(records: list[dict], out_dir: Path, args, started: float,
                 commit: str) -> None:
    from benchmarks.machine import machine_info

    write_tables(records, out_dir)
    machine = machine_info()
    try:
        import torch

        machine["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        pass
    record_run(out_dir, mode="goodput control's floor on a GPU", description=(
        "decode throughput inside vLLM with random weights (load_format dummy, drafts never "
        "accepted): an 8B-shaped target alone against goodput control with a 1B-shaped "
        "draft_model, K = 4, prefix-cached prompts"),
        command="python -m benchmarks.gpu_floor " + " ".join(sys.argv[1:]),
        title=json.dumps(args_record(args)), machine=machine, dtype="bfloat16",
        started=started, commit=commit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results-local/gpu-floor"))
    parser.add_argument("--shapes", nargs="+", default=["1x8192", "8x4096", "32x2048"],
                        help="batch x context, e.g. 8x4096")
    parser.add_argument("--configs", nargs="+", default=["target", "target_sync", "goodput"],
                        choices=CONFIGS)
    parser.add_argument("--graphs", choices=list(GRAPHS), default="full")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per engine")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="only write --out's tables from these runs' results.json "
                             "(engines that failed in one run and ran in another)")
    parser.add_argument("--one", nargs=2, metavar=("CONFIG", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.merge:
        records = [r for path in args.merge for r in json.loads(path.read_text())]
        args.out.mkdir(parents=True, exist_ok=True)
        write_tables([r for r in records if "error" not in r] or records, args.out)
        return
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes]
    if args.one:
        run_one(args.one[0], shapes, args.graphs, args.rounds, args.max_tokens, args.tiny,
                Path(args.one[1]))
        return
    started, commit = time.time(), git_commit()
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for config in args.configs:
        out = args.out / f"{config}.json"
        print(f"[gpu_floor] {config}", flush=True)
        command = [sys.executable, "-m", "benchmarks.gpu_floor", "--one", config, str(out),
                   "--shapes", *args.shapes, "--graphs", args.graphs, "--rounds",
                   str(args.rounds), "--max-tokens", str(args.max_tokens)]
        try:
            subprocess.run(command + (["--tiny"] if args.tiny else []), check=True,
                           timeout=args.timeout)
            records.append(json.loads(out.read_text()))
            out.unlink()
        except (subprocess.SubprocessError, OSError) as error:
            records.append({"config": config, "error": repr(error)})
        write_report(records, args.out, args, started, commit)


if __name__ == "__main__":
    main()
