"""Served benchmark: each configuration behind the OpenAI server (`vllm serve`),
measured with vLLM's own `vllm bench serve`.

Per configuration one server (prefix caching on); a warm-up pass sends every
prompt with ``WARM_UP_TOKENS`` output tokens, so the measured pass
(``--max-concurrency N``, ``--ignore-eos``) finds the prompts in the prefix
cache and measures decode under concurrency: output tokens/s, TTFT and TPOT
(median, p99). Acceptance and drafted tokens are `vllm bench serve`'s
reading of the server's Prometheus counters (``vllm:spec_decode_*``) around
the measured pass; goodput control's counters of that pass are read the
same way (``control``).

    python -m benchmarks --serve --concurrency 8 --lengths 8192
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from benchmarks.batch import plot_by_batch_size
from benchmarks.corpus import load_corpus
from benchmarks.machine import machine_info
from benchmarks.prompts import summarization_prompt
from benchmarks.report import args_record, fmt, fmt_ratio
from benchmarks.runs import K_BY_BATCH_SIZE

SERVE_CONFIGS = ("target", "draft_model", "cmr", "streaming", "cmr_k_by_batch", "goodput")
PASSAGE_STRIDE = 60_000
SERVED_NAME = "target"
VLLM = str(Path(sys.executable).parent / "vllm")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(args, config: str, port: int, max_len: int) -> list[str]:
    command = [VLLM, "serve", args.target, "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
               "--max-model-len", str(max_len), "--max-num-seqs", str(args.concurrency),
               "--enable-prefix-caching", "--gpu-memory-utilization", "0.5",
               "--kv-cache-memory-bytes", str(args.kv_cache_gib << 30), "--seed", "0"]
    if args.eager:
        command.append("--enforce-eager")
    if args.block_size:
        command += ["--block-size", str(args.block_size)]
    if config != "target":
        speculative = {"method": args.method, "model": args.draft,
                       "num_speculative_tokens": args.k}
        if args.draft_window:
            speculative["max_model_len"] = args.draft_window
        if config == "cmr_k_by_batch":
            speculative["num_speculative_tokens_per_batch_size"] = K_BY_BATCH_SIZE
        command += ["--speculative-config", json.dumps(speculative)]
    if config in ("cmr", "streaming", "cmr_k_by_batch", "goodput"):
        base = json.loads(args.spec_extend) if args.spec_extend else {}
        options = {**base, "mode": "streaming" if config == "streaming" else "cmr"}
        if config == "goodput":
            options["speculation_control"] = "goodput"
        command += ["--additional-config", json.dumps({"spec_extend": options})]
    return command


@contextlib.contextmanager
def running_server(command: list[str], port: int, log_path: Path, timeout_s: float = 600,
                   env: dict[str, str] | None = None):
    """Run ``command`` (a ``vllm serve`` line listening on ``port``) until
    the block ends; yields its base URL and its open log (stdout + stderr)."""
    with open(log_path, "w+") as log:
        # Unbuffered, so the log holds every line the server has written so far.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + timeout_s
            while time.time() < deadline:
                if process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"server exited early ({log_path}):\n"
                                       f"{log.read()[-4000:]}")
                with contextlib.suppress(requests.ConnectionError):
                    if requests.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                time.sleep(1)
            else:
                raise TimeoutError(f"server not healthy in {timeout_s:.0f} s; see {log_path}")
            yield base, log
        finally:
            process.terminate()
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()


def bench_serve(args, port: int, dataset: Path, output_len: int,
                result_file: Path | None) -> dict[str, Any] | None:
    command = [VLLM, "bench", "serve", "--backend", "vllm", "--base-url",
               f"http://127.0.0.1:{port}", "--model", args.target,
               "--served-model-name", SERVED_NAME, "--dataset-name", "custom",
               "--dataset-path", str(dataset), "--skip-chat-template",
               "--num-prompts", str(args.concurrency), "--disable-shuffle",
               "--custom-output-len", str(output_len), "--ignore-eos",
               # Greedy, as the offline runs: without it the server samples
               # with the model's generation_config (e.g. temperature 0.7).
               "--temperature", "0",
               "--max-concurrency", str(args.concurrency),
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    if result_file is not None:
        command += ["--save-result", "--result-dir", str(result_file.parent),
                    "--result-filename", result_file.name]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=3600)
    return json.loads(result_file.read_text()) if result_file is not None else None


def run_serve(args) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    text = load_corpus(args.corpus)
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = [c for c in args.configs if c in SERVE_CONFIGS]
    with tqdm(total=len(configs) * len(args.lengths), desc="served benchmark",
              unit="run") as progress:
        for length in args.lengths:
            dataset = out_dir / f"prompts-{length}.jsonl"
            with open(dataset, "w") as f:
                for i in range(args.concurrency):
                    ids = summarization_prompt(tokenizer, text, length,
                                               offset=args.offset + i * PASSAGE_STRIDE)
                    f.write(json.dumps({"prompt": tokenizer.decode(ids)}) + "\n")
            for config in configs:
                port = free_port()
                progress.set_postfix_str(f"{config} {length}: server")
                command = server_command(args, config, port, length + args.max_tokens + 256)
                log_path = out_dir / f"server-{config}-{length}.log"
                with running_server(command, port, log_path) as (base, _):
                    progress.set_postfix_str(f"{config} {length}: prefill")
                    bench_serve(args, port, dataset, WARM_UP_TOKENS, None)
                    progress.set_postfix_str(f"{config} {length}: measure")
                    controlled = config == "goodput"
                    before = control_counters(base) if controlled else {}
                    result = bench_serve(args, port, dataset, args.max_tokens,
                                         out_dir / f"bench-{config}-{length}.json")
                    after = control_counters(base) if controlled else {}
                row = served_row(config, length, args.concurrency, result)
                if after:
                    row["control"] = {name: value - before.get(name, 0.0)
                                      for name, value in after.items()}
                (out_dir / f"row-{config}-{length}.json").write_text(json.dumps(row))
                progress.update(1)
    # Rows of earlier runs into the same folder (other configurations) join.
    order = {c: i for i, c in enumerate(SERVE_CONFIGS)}
    rows = sorted((json.loads(p.read_text()) for p in out_dir.glob("row-*.json")),
                  key=lambda r: (r["context_tokens"], order.get(r["config"], 99)))
    return {"machine": machine_info(),
            "args": args_record(args),
            "measurements": rows}


WARM_UP_TOKENS = 16
"""The warm-up pass prefills the passages (into the prefix cache) and
decodes a few tokens, so that goodput control has timed decode steps before
the measured pass, as in a serving engine that has run for a while."""
CONTROL_PREFIX = "vllm:spec_extend_control_"


METRICS_LAG_S = 11
"""SpecExtend's figures reach ``/metrics`` when vLLM logs its stats (every
10 s by default)."""


def control_counters(base: str) -> dict[str, float]:
    """Goodput control's counters on the server's Prometheus ``/metrics``
    (summed over labels; none without goodput control), once the last
    steps' have been published."""
    time.sleep(METRICS_LAG_S)
    counters: dict[str, float] = {}
    for line in requests.get(f"{base}/metrics", timeout=30).text.splitlines():
        if not line.startswith(CONTROL_PREFIX) or "_bucket" in line or "_created" in line:
            continue
        name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
        name = name.removeprefix(CONTROL_PREFIX).removesuffix("_total")
        counters[name] = counters.get(name, 0.0) + value
    return counters


def served_row(config: str, length: int, concurrency: int, result: dict) -> dict:
    """One table row from a `vllm bench serve` result file (its spec_decode_*
    figures are the server's Prometheus counters around the measured pass)."""
    return {
        "config": config, "context_tokens": length, "batch_size": concurrency,
        "output_tok_s": result["output_throughput"],
        "median_ttft_ms": result["median_ttft_ms"], "p99_ttft_ms": result["p99_ttft_ms"],
        "median_tpot_ms": result["median_tpot_ms"], "p99_tpot_ms": result["p99_tpot_ms"],
        "mean_acceptance_length": result.get("spec_decode_acceptance_length"),
        "drafted_tokens": result.get("spec_decode_draft_tokens"),
        "output_tokens": result["total_output_tokens"],
        "date": result.get("date"),
    }


def serve_table(rows: list[dict]) -> str:
    lines = ["| config | concurrency | context | output tok/s | median TPOT ms | p99 TPOT ms | "
             "TPOT vs draft_model | median TTFT ms | p99 TTFT ms | mean acc. len | "
             "drafted / output tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    stock = {r["context_tokens"]: r for r in rows if r["config"] == "draft_model"}
    for r in rows:
        ref = stock.get(r["context_tokens"])
        lines.append(
            f"| {r['config']} | {r['batch_size']} | {r['context_tokens']} | "
            f"{r['output_tok_s']:.2f} | {r['median_tpot_ms']:.0f} | {r['p99_tpot_ms']:.0f} | "
            f"{fmt_ratio(r['median_tpot_ms'] / ref['median_tpot_ms'] if ref else None)} | "
            f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
            f"{fmt(r['mean_acceptance_length'])} | "
            f"{fmt(r['drafted_tokens'], 'd')} / {r['output_tokens']} |")
    return "\n".join(lines)


def write_serve(result: dict[str, Any], out_dir: Path, title: str) -> str:
    rows = result["measurements"]
    table = serve_table(rows)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    (out_dir / "results.md").write_text(
        f"# {title}\n\n`vllm serve` per configuration, measured with `vllm bench serve` "
        "(custom dataset of the passages, `--max-concurrency` = number of prompts, "
        "`--ignore-eos`); the prompts were prefix-cached by a warm-up pass, so TTFT is the "
        "queueing and last-block recompute, not a full prefill. Configurations run "
        "separately into the same folder join the table; each row's date is in "
        "results.json.\n\n"
        f"{table}\n")
    plot_by_batch_size([r | {"value": r["output_tok_s"]} for r in rows],
                       out_dir / "results.png", title, "output tokens/s (served)")
    return table
