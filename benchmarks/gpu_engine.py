"""End-to-end step times inside vLLM on a CUDA GPU, with random weights.

An 8B-shaped target (Llama-3-8B's config) and a 1B-shaped draft_model
(Llama-3.2-1B's), ``load_format="dummy"`` (weights drawn from the config
alone: nothing to download or carry), bf16, K = 4, drafting forced (goodput
control off). Per decode step, timed with CUDA events on the runner's stream:
the target's step (``execute_model``), the draft's (``propose``) and, with cmr,
the planning call inside it. Acceptance means nothing with random weights;
step times do. One engine per (configuration, graph mode), each in a process
of its own.

    python -m benchmarks.gpu_engine --out benchmarks/results/gpu-engine \\
        --shapes 8x32768 --configs draft_model cmr --graphs eager full_decode_only

On a machine without a vLLM build for its torch, run it through the
stand-in: ``bash tests/gpu/standin/run.sh python3 -m benchmarks.gpu_engine ...``.
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

K = 4
LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128)
LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                    tie_word_embeddings=True)
SHARED = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
              max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
              hidden_act="silu", torch_dtype="bfloat16", bos_token_id=128000,
              eos_token_id=128001)
GRAPHS = {"eager": "NONE", "full_decode_only": "FULL_DECODE_ONLY", "full": "FULL"}


def write_config(folder: Path, shape: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**SHARED, **shape}, indent=1))
    return folder


def install_event_timers(worker) -> None:
    """CUDA events around the target's step, the draft's and the planning
    call, kept for decode steps (every request's query at most K + 1)."""
    import torch

    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    retrieval = getattr(drafter, "retrieval", None)
    events: list[tuple[str, object, object]] = []
    runner._bench_events = events
    state = {"decode": False}

    def timed(owner, name, key, starts_step=False):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if starts_step:
                scheduled = (args[0] if args else kwargs["scheduler_output"]).num_scheduled_tokens
                state["decode"] = bool(scheduled) and max(scheduled.values()) <= K + 1
            if not state["decode"]:
                return original(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return original(*args, **kwargs)
            finally:
                end.record()
                events.append((key, start, end))

        setattr(owner, name, wrapper)

    timed(runner, "execute_model", "target", starts_step=True)
    if drafter is not None:
        timed(drafter, "propose", "draft")
    if retrieval is not None:
        timed(retrieval, "plan", "plan")


def read_event_timers(worker) -> dict:
    import torch

    torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for key, start, end in worker.model_runner._bench_events:
        times.setdefault(key, []).append(start.elapsed_time(end))
    return times


def run_one(config: str, graphs: str, batch: int, context: int, out: Path) -> None:
    """One engine; writes its step times as JSON to ``out``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import numpy as np
    from vllm import LLM, SamplingParams, TokensPrompt

    models = Path(tempfile.mkdtemp(prefix="gpu-engine-"))
    target = write_config(models / "target-8b", LLAMA_3_8B)
    draft = write_config(models / "draft-1b", LLAMA_3_2_1B)
    compilation = {"cudagraph_mode": GRAPHS[graphs], "mode": 0}
    kwargs = dict(model=str(target), load_format="dummy", dtype="bfloat16",
                  skip_tokenizer_init=True, max_model_len=context + 256, max_num_seqs=batch,
                  gpu_memory_utilization=0.9, enable_prefix_caching=False,
                  enforce_eager=graphs == "eager", compilation_config=compilation,
                  speculative_config={"method": "draft_model", "model": str(draft),
                                      "num_speculative_tokens": K}, seed=0)
    if os.environ.get("SPECEXTEND_GPU_STANDIN") == "1":
        compilation["custom_ops"] = ["none"]
        kwargs["attention_backend"] = "TRITON_ATTN"
    if config == "cmr":
        kwargs["additional_config"] = {"spec_extend": {}}
    started = time.time()
    llm = LLM(**kwargs)
    ready = time.time()
    llm.collective_rpc(install_event_timers)
    rng = np.random.default_rng(0)
    prompts = [TokensPrompt(prompt_token_ids=rng.integers(1000, 100000, context).tolist())
               for _ in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                 use_tqdm=False)
    times = llm.collective_rpc(read_event_timers)[0]
    out.write_text(json.dumps({"config": config, "graphs": graphs, "batch": batch,
                               "context": context, "engine_start_s": ready - started,
                               "run_s": time.time() - ready, "times_ms": times}))


def summarize(record: dict) -> dict:
    import numpy as np

    times = record["times_ms"]
    median = {key: float(np.median(values)) for key, values in times.items()}
    # Steady state: the second half of the decode steps.
    steady = {key: float(np.median(values[len(values) // 2:])) for key, values in times.items()}
    return {**{k: v for k, v in record.items() if k != "times_ms"},
            "steps": len(times.get("target", [])),
            "target_ms": steady.get("target"), "draft_ms": steady.get("draft"),
            "plan_ms": steady.get("plan"),
            "plan_share_of_step": (steady["plan"] / (steady["target"] + steady["draft"])
                                   if "plan" in steady else None),
            "median_all_steps": median}


def write_report(rows: list[dict], out_dir: Path, args, started: float,
                 commit: str) -> None:
    from benchmarks.machine import machine_info

    (out_dir / "results.json").write_text(json.dumps(rows, indent=1))
    stock = {(r["graphs"], r["batch"], r["context"]): r for r in rows
             if r["config"] == "draft_model" and "error" not in r}
    lines = ["| batch x context | graphs | config | target step ms | draft step ms | "
             "draft vs stock | plan ms | plan share of step |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} x {r['context']} | {r['graphs']} | {r['config']} | "
                         f"failed: {r['error'][:80]} | | | | |")
            continue
        base = stock.get((r["graphs"], r["batch"], r["context"]))
        ratio = r["draft_ms"] / base["draft_ms"] if base and r["draft_ms"] else None
        lines.append(f"| {r['batch']} x {r['context']} | {r['graphs']} | {r['config']} | "
                     f"{fmt(r['target_ms'])} | {fmt(r['draft_ms'])} | {fmt_ratio(ratio)} | "
                     f"{fmt(r['plan_ms'], '.3f')} | "
                     f"{fmt(None if r['plan_share_of_step'] is None else 100 * r['plan_share_of_step'], '.1f')}% |")
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ok = [r for r in rows if "error" not in r]
    labels = sorted({f"{r['batch']}x{r['context']} {r['graphs']}" for r in ok})
    for i, config in enumerate(("draft_model", "cmr")):
        values = [next((r["draft_ms"] for r in ok if r["config"] == config and
                        f"{r['batch']}x{r['context']} {r['graphs']}" == label), 0) for label in labels]
        ax.bar([j + 0.4 * i for j in range(len(labels))], values, width=0.4, label=config,
               color=config_color(config))
    ax.set_xticks([j + 0.2 for j in range(len(labels))], labels)
    ax.set_ylabel("draft step (ms, K = 4)")
    ax.legend()
    save_figure(fig, out_dir / "results.png", "Draft step: stock draft_model vs cmr, 8B / 1B shapes")
    record_run(out_dir, mode="GPU engine step times", description=(
        "step times inside vLLM on a GPU, random weights (load_format dummy): an 8B-shaped "
        "target and a 1B-shaped draft_model, K = 4, drafting forced"),
        command="python -m benchmarks.gpu_engine " + " ".join(sys.argv[1:]),
        title=json.dumps(args_record(args)), machine=machine_info(), dtype="bfloat16",
        started=started, commit=commit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results-local/gpu-engine"))
    parser.add_argument("--shapes", nargs="+", default=["8x32768"],
                        help="batch x context, e.g. 8x32768 64x8192")
    parser.add_argument("--configs", nargs="+", default=["draft_model", "cmr"],
                        choices=["draft_model", "cmr"])
    parser.add_argument("--graphs", nargs="+", default=["eager", "full_decode_only"],
                        choices=list(GRAPHS))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per engine")
    parser.add_argument("--runner", choices=["v1", "mrv2"], default="v1",
                        help="vLLM's model runner for every engine (stock drafting would "
                             "otherwise take vLLM's default, MRV2 on CUDA, and cmr V1)")
    parser.add_argument("--one", nargs=5, metavar=("CONFIG", "GRAPHS", "BATCH", "CONTEXT", "JSON"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        config, graphs, batch, context, out = args.one
        run_one(config, graphs, int(batch), int(context), Path(out))
        return
    started, commit = time.time(), git_commit()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "mrv2" else "0"
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes:
        batch, context = map(int, shape.split("x"))
        for graphs in args.graphs:
            for config in args.configs:
                out = args.out / f"{config}-{graphs}-{shape}.json"
                print(f"[gpu_engine] {config} {graphs} {shape}", flush=True)
                try:
                    subprocess.run([sys.executable, "-m", "benchmarks.gpu_engine", "--one", config,
                                    graphs, str(batch), str(context), str(out)],
                                   check=True, timeout=args.timeout)
                    rows.append(summarize(json.loads(out.read_text())))
                    out.unlink()
                except (subprocess.SubprocessError, OSError) as error:
                    rows.append({"config": config, "graphs": graphs, "batch": batch,
                                 "context": context, "error": repr(error)})
                print(f"[gpu_engine] {rows[-1]}", flush=True)
    write_report(rows, args.out, args, started, commit)


if __name__ == "__main__":
    main()
