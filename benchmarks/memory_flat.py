"""Memory over an engine run with many retrievals: is it flat?

Retrieval's buffers (scoring's workspace, the tap, the re-positioning
workspace) are allocated once, before vLLM measures free memory; per step
nothing key-sized is allocated. This runs one engine on the tests' tiny
models (a Llama target and a copy of it with a 512-position window, so the
draft runs at compact positions and re-positions its working cache at every
retrieval), retrieving at every step, and records after each round of
requests the worker's resident memory, the retrievals so far and whether the
re-positioning workspace still holds the same storage.

    python -m benchmarks.memory_flat                 # 8 rounds, about 3 min on 2 cores
    python -m benchmarks.memory_flat --rounds 3      # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from benchmarks.machine import machine_info
from benchmarks.report import config_color, git_commit, pyplot, record_run, save_figure

RETRIEVE_EVERY_STEP = {"top_k_chunks": 2, "sink_tokens": 32, "recent_tokens": 256,
                       "min_context_tokens": 512, "retrieval_interval": 1}
PROMPT_LENGTHS = [2500, 3800, 3000, 2000, 3300, 2700]


def worker_memory(worker) -> dict:
    """The worker's resident memory, retrievals so far and the storage of the
    re-positioning workspace (runs inside the worker)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    retrieval = worker.model_runner.drafter.retrieval
    workspace = retrieval.repositioning_workspace
    return {"rss_mib": rss / 2**20,
            "retrievals": int(retrieval.planner.stats.as_dict()["retrievals"]),
            "workspace_storage": [t.data_ptr() for t in workspace.tensors()],
            "workspace_mib": workspace.nbytes / 2**20}


def measure(rounds: int, max_tokens: int) -> list[dict]:
    from tests.engine_utils import corpus_prompts, engine, generate_greedy
    from tests.tiny_models import TARGET_LLAMA, build_damped_attention_copy, build_short_window_copy

    target = build_damped_attention_copy(TARGET_LLAMA, 0.05)
    draft = build_short_window_copy(target, 512)
    prompts = corpus_prompts(target, PROMPT_LENGTHS)
    rows: list[dict] = []
    with engine(target, draft, spec_extend=RETRIEVE_EVERY_STEP) as llm:
        first_storage = None
        for round_index in range(rounds):
            started = time.time()
            generate_greedy(llm, prompts, max_tokens)
            info = llm.collective_rpc(worker_memory)[0]
            first_storage = first_storage or info["workspace_storage"]
            rows.append({"round": round_index, "rss_mib": round(info["rss_mib"], 1),
                         "retrievals": info["retrievals"],
                         "workspace_mib": round(info["workspace_mib"], 2),
                         "same_workspace_storage": info["workspace_storage"] == first_storage,
                         "seconds": round(time.time() - started, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def write(rows: list[dict], out: Path, command: str, started: float, commit: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    title = (f"tiny Llama target + 512-position draft at compact positions, fp32, "
             f"{len(PROMPT_LENGTHS)} prompts of 2.0K-3.8K tokens a round, retrieval every step")
    (out / "results.json").write_text(json.dumps({"rows": rows, "setting": title,
                                                  "spec_extend": RETRIEVE_EVERY_STEP}, indent=1))
    lines = ["| round | retrievals so far | worker RSS MiB | re-positioning workspace MiB "
             "| same storage |", "|---:|---:|---:|---:|---|"]
    lines += [f"| {r['round']} | {r['retrievals']} | {r['rss_mib']:.1f} | {r['workspace_mib']} "
              f"| {'yes' if r['same_workspace_storage'] else 'no'} |" for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["retrievals"] for r in rows], [r["rss_mib"] for r in rows], marker="o",
            color=config_color("cmr"), label="cmr, compact positions")
    ax.set_xlabel("retrievals so far")
    ax.set_ylabel("worker resident memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend()
    save_figure(fig, out / "results.png", "Worker memory over many retrievals")
    record_run(out, mode="memory_flat", description="worker memory over many retrievals",
               command=command, title=title, machine=machine_info(), dtype="float32",
               started=started, commit=commit)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_flat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of the six requests")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per request a round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results-local/memory-flat"),
                        help="output folder")
    args = parser.parse_args(argv)
    started, commit = time.time(), git_commit()
    rows = measure(args.rounds, args.max_tokens)
    write(rows, args.out, "python -m benchmarks.memory_flat " + shlex.join(sys.argv[1:]), started,
          commit)


if __name__ == "__main__":
    main()
