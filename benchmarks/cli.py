"""Benchmarks of SpecExtend against stock vLLM on the real models.

One mode per run (default: one request at a time; batches with --batch-sizes):

    python -m benchmarks                                 # single requests (runs.py)
    python -m benchmarks --batch-sizes 1 4 8             # batches (batch.py)
    python -m benchmarks --serve --concurrency 8         # vllm serve (serve.py)
    python -m benchmarks --sweep                         # option sweep (sweep.py)
    python -m benchmarks --needle                        # needle retrieval (needle.py)
    python -m benchmarks --refresh                       # retrieval refresh (refresh.py)
    python -m benchmarks --k-trace                       # goodput's K per step (k_trace.py)
    python -m benchmarks --eagle3                        # EAGLE-3 head (eagle3_long.py)
    python -m benchmarks --soak                          # served soak, 30 min (soak.py)
    python -m benchmarks --document-qa                   # one cached document (document_qa.py)

A run writes its tables (JSON, markdown, PNG) and a README.md (command,
commit, machine, dtype, date) to benchmarks/results-local/MODE, which git
ignores; --out or --name choose another folder.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from benchmarks.corpus import CORPUS_DIR
from benchmarks.machine import (
    HUGE_PAGES_FOR_MALLOC,
    HUGE_PAGES_FOR_TORCH,
    fast_dtype,
    machine_info,
)
from benchmarks.needle import run_needle, write_needle
from benchmarks.report import LOCAL_RESULTS_DIR, git_commit, record_run
from benchmarks.runs import run_benchmark, write_results
from benchmarks.sweep import run_sweep, write_sweep

MODES = {
    "single": "one request at a time, one engine per configuration (runs.py)",
    "batch": "N passages per LLM.generate call for each N of --batch-sizes (batch.py)",
    "serve": "vllm serve per configuration, measured with vllm bench serve (serve.py)",
    "sweep": "retrieval options one at a time (sweep.py)",
    "needle": "needle retrieval: draft acceptance on a hidden pass key (needle.py)",
    "refresh": "retrieval refresh: fixed interval against acceptance drops (refresh.py)",
    "k-trace": "goodput control's drafts per request and step, one batch (k_trace.py)",
    "eagle3": "an EAGLE-3 head on long inputs: stock full attention, sliding window, cmr, "
              "streaming, goodput (eagle3_long.py)",
    "soak": "vllm serve with cmr at compact positions under a mixed load with faults, "
            "then every completed request replayed alone (soak.py)",
    "document-qa": "questions on one cached document: private layouts, in place, "
                   "without prefix caching, alone (document_qa.py)",
}
"""Mode name (also the default results folder) -> what it measures."""

MODES_WITH_BATCH_SIZES = ("batch", "eagle3")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in --help, except where the default depends on the mode (None)
    or is an off switch; the module docstring keeps its line breaks."""

    def _get_help_string(self, action):
        if action.default in (None, False) or isinstance(action, argparse._StoreConstAction):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=HelpFormatter)
    modes = parser.add_argument_group(
        "mode", "one at most; without one: single requests, or batches with --batch-sizes")
    mode = modes.add_mutually_exclusive_group()
    for name in MODES:
        if name not in ("single", "batch"):
            mode.add_argument(f"--{name}", dest="mode", action="store_const", const=name,
                              help=MODES[name])

    models = parser.add_argument_group("models")
    models.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="local path, hub id, or a short name from benchmarks.real_models")
    models.add_argument("--draft", default=None,
                        help="the draft model (default qwen2.5-coder-0.5b), or with --method "
                             "eagle/eagle3 the EAGLE head (--eagle3: default the head "
                             "scripts/make_eagle_head.sh trains)")
    models.add_argument("--method", default="draft_model",
                        choices=["draft_model", "eagle", "eagle3"],
                        help="speculative method of --draft; the draft_model configuration "
                             "is stock drafting with it")
    models.add_argument("--heterogeneous-vocab", action="store_true",
                        help="draft with its own tokenizer (use_heterogeneous_vocab)")
    models.add_argument("--dtype", default="auto",
                        help="model dtype; auto: bfloat16 where this CPU has fast bf16 "
                             "matmuls (AVX-512 BF16/AMX, or a GPU), else float32 "
                             "(--soak: float32)")

    workload = parser.add_argument_group("workload")
    workload.add_argument("--corpus", type=Path, nargs="+", default=None,
                          help="texts or folders of texts (default the shipped corpus; "
                               "--eagle3: the novel the head's training held out)")
    workload.add_argument("--offset", type=int, default=100_000,
                          help="character offset of the passages in the corpus")
    workload.add_argument("--lengths", type=int, nargs="+", default=None,
                          help="context lengths in tokens (default 1024 4096 8192; --sweep: "
                               "4096 8192; --eagle3: 1024 4096 8192 16384; --soak: the long "
                               "prompts, 4096 8192 16384; --document-qa: 8192)")
    workload.add_argument("--max-tokens", type=int, default=96,
                          help="greedy output tokens per request")
    workload.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                          help="batches: N passages per LLM.generate call for each N, e.g. "
                               "--batch-sizes 1 4 8 (also --eagle3: default 1 4)")
    workload.add_argument("--concurrency", type=int, default=8,
                          help="--serve / --soak: prompts and --max-concurrency; "
                               "--document-qa: questions")

    configs = parser.add_argument_group("configurations")
    configs.add_argument("--configs", nargs="+", default=None,
                         help="default target, draft_model, cmr, streaming; batches and "
                              "--serve also goodput (cmr with speculation_control goodput), "
                              "always_paused (batches: goodput forced to pause every "
                              "request, its floor on the same engine), target_sync (the "
                              "target alone, synchronous scheduler), ngram_no_match (stock "
                              "vLLM's spec decoding with zero drafts: an n-gram that never "
                              "matches, synchronous scheduler) and "
                              "cmr_k_by_batch (vLLM's K-by-batch-size schedule); single "
                              "requests also draft_model_full, ngram; --eagle3: target, "
                              "eagle3_full, eagle3_sliding, cmr, streaming, goodput (all by "
                              "default); batches without --rounds open their engines in "
                              "this order")
    configs.add_argument("--k", type=int, default=None,
                         help="num_speculative_tokens (default 4; --eagle3: the head's "
                              "training-time test depth)")
    configs.add_argument("--spec-extend", default=None,
                         help="JSON spec_extend options for cmr/streaming (defaults otherwise)")
    configs.add_argument("--draft-window", type=int, default=None,
                         help="cap the draft's window (speculative_config max_model_len) in "
                              "every draft configuration but draft_model_full (--soak, "
                              "--document-qa: default 2048, compact positions)")

    engine = parser.add_argument_group("engine")
    engine.add_argument("--block-size", type=int, default=None,
                        help="KV cache block size in tokens (default vLLM's: 128 on CPU)")
    engine.add_argument("--kv-cache-gib", type=int, default=3,
                        help="KV cache size per engine (kv_cache_memory_bytes), GiB")
    engine.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="enforce_eager (torch.compile start-up is slow on 2 cores)")
    engine.add_argument("--rounds", type=int, default=1,
                        help="batches / --eagle3: open every engine at once and run each "
                             "point this many times, the engines taking turns; report each "
                             "configuration's median round (for hosts whose speed drifts; "
                             "needs memory for all engines)")

    per_mode = parser.add_argument_group("mode options")
    per_mode.add_argument("--sweep-points", default=None,
                          help="--sweep: JSON list of option dicts to sweep instead of the "
                               "built-in points, each applied on top of --spec-extend")
    per_mode.add_argument("--needle-length", type=int, default=4096,
                          help="--needle: context tokens around the pass key")
    per_mode.add_argument("--needle-tokens", type=int, default=12,
                          help="--needle: greedy tokens of each answer")
    per_mode.add_argument("--refresh-length", type=int, default=4096,
                          help="--refresh: context tokens")
    per_mode.add_argument("--refresh-tokens", type=int, default=320,
                          help="--refresh: tokens generated for each two-paragraph copy")
    per_mode.add_argument("--max-batch-tokens", type=int, default=None,
                          help="--eagle3: leave out batches of more prompt tokens than this "
                               "(the smallest batch always runs)")
    per_mode.add_argument("--soak-minutes", type=float, default=30,
                          help="--soak: minutes of load")
    per_mode.add_argument("--soak-tokens", type=int, default=32,
                          help="--soak: greedy tokens per request")
    per_mode.add_argument("--soak-replay-minutes", type=float, default=15,
                          help="--soak: time for replaying the completed requests alone")

    output = parser.add_argument_group("output")
    output.add_argument("--name", default=None,
                        help="results folder under benchmarks/results-local (untracked; "
                             "default: the mode's name)")
    output.add_argument("--out", type=Path, default=None,
                        help="results folder (overrides --name); committed results live "
                             "in benchmarks/results, indexed in benchmarks/README.md")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mode is None:
        args.mode = "batch" if args.batch_sizes else "single"
    elif args.batch_sizes and args.mode not in MODES_WITH_BATCH_SIZES:
        parser.error(f"--batch-sizes applies to batches and --eagle3, not --{args.mode}")
    if args.mode == "eagle3":
        args.method = "eagle3"
        args.batch_sizes = args.batch_sizes or [1, 4]
        args.configs = args.configs or ["target", "eagle3_full", "eagle3_sliding", "cmr",
                                        "streaming", "goodput"]
    args.configs = args.configs or ["target", "draft_model", "cmr", "streaming"]
    args.lengths = args.lengths or {
        "sweep": [4096, 8192], "eagle3": [1024, 4096, 8192, 16384],
        "soak": [4096, 8192, 16384], "document-qa": [8192],
    }.get(args.mode, [1024, 4096, 8192])
    if args.mode in ("soak", "document-qa"):
        args.draft_window = args.draft_window or 2048
    return args


def use_all_cores() -> None:
    """vLLM's CPU worker reserves one core for the front end by default, which
    halves a 2-core machine; offline runs and our single server want every
    core for the model's threads (unless the user set the binding)."""
    cores = sorted(os.sched_getaffinity(0))
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        contiguous = cores == list(range(cores[0], cores[-1] + 1))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = (
            f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores)))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def use_huge_pages() -> None:
    """Engines' memory on transparent huge pages, unless the user chose:
    torch's tensors (``THP_MEM_ALLOC_ENABLE``) and what libraries malloc,
    oneDNN's packed weights among them (glibc's ``glibc.malloc.hugetlb``).
    Decode on a CPU reads every weight each step; on 4 KiB pages the speed
    depends on where the pages land (on our 2-core VM the first of two
    3 GiB buffers of a process read 1.25-1.30x slower than the second, and
    the first of two identical target-alone engines ran 1.13-1.25x slower);
    on huge pages 23-25 GB/s and 0.97x (``results/huge-pages``). Every
    configuration gets them alike."""
    os.environ.setdefault(HUGE_PAGES_FOR_TORCH, "1")
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    tunable = HUGE_PAGES_FOR_MALLOC.split("=")[0]
    if tunable not in tunables:
        os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, (tunables, HUGE_PAGES_FOR_MALLOC)))


def run_mode(args, out_dir: Path, title: str) -> tuple[str, str]:
    """Run ``args.mode``; return its table and the files it wrote."""
    if args.mode == "single":
        return write_results(run_benchmark(args), out_dir, title), "results.{json,md,png}"
    if args.mode == "sweep":
        return write_sweep(run_sweep(args), out_dir, title), "sweep.{json,md}"
    if args.mode == "needle":
        return write_needle(run_needle(args), out_dir), "needle.{json,md,png}"
    if args.mode == "batch":
        from benchmarks.batch import run_batch, write_batch

        return write_batch(run_batch(args), out_dir, title), "results.{json,md,png}"
    if args.mode == "serve":
        from benchmarks.serve import run_serve, write_serve

        return write_serve(run_serve(args), out_dir, title), "results.{json,md,png}"
    if args.mode == "eagle3":
        from benchmarks.eagle3_long import run_eagle3, write_eagle3

        return write_eagle3(run_eagle3(args), out_dir, title), "eagle3.{json,md,png}"
    if args.mode == "k-trace":
        from benchmarks.k_trace import run_k_trace, write_k_trace

        return write_k_trace(run_k_trace(args), out_dir, title), "k_trace.{json,md,png}"
    if args.mode == "refresh":
        from benchmarks.refresh import run_refresh, write_refresh

        return write_refresh(run_refresh(args), out_dir, title), "refresh.{json,md,png}"
    if args.mode == "document-qa":
        from benchmarks.document_qa import run_document_qa, write_document_qa

        return (write_document_qa(run_document_qa(args), out_dir, title),
                "document_qa.{json,md,png}")
    if args.mode == "soak":
        from benchmarks.soak import run_soak, write_soak

        return write_soak(run_soak(args), out_dir, title), "soak.{json,md,png}"
    raise AssertionError(f"unknown mode {args.mode!r}")


def main(argv=None) -> None:
    command = shlex.join(["python", "-m", "benchmarks", *(sys.argv[1:] if argv is None else argv)])
    args = parse_args(argv)
    from benchmarks.real_models import resolve_model

    args.target = resolve_model(args.target)
    if args.mode == "eagle3":
        from benchmarks.eagle_head import HELD_OUT_NOVEL, default_head_dir, head_draft_length

        args.draft = args.draft or str(default_head_dir(args.target))
        args.corpus = args.corpus or [CORPUS_DIR / f"{HELD_OUT_NOVEL}.txt.gz"]
        args.k = args.k or head_draft_length(args.draft)
    args.draft = resolve_model(args.draft or "qwen2.5-coder-0.5b")
    args.corpus = args.corpus or [CORPUS_DIR]
    args.k = args.k or 4
    if args.mode == "soak":
        # Batched and solo outputs are compared token for token: float32.
        args.dtype = "float32" if args.dtype == "auto" else args.dtype
    if args.dtype == "auto":
        args.dtype = fast_dtype()
    # Slow CPUs can spend minutes on one long prefill step; vLLM's default
    # step timeout (300 s) would kill the engine.
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    use_all_cores()
    use_huge_pages()
    out_dir = args.out or LOCAL_RESULTS_DIR / (args.name or args.mode)
    args.out = out_dir  # served modes write their server logs there
    if args.mode == "refresh":
        args.max_tokens = args.refresh_tokens  # the longest answer, in the title
    if args.mode == "soak":
        args.max_tokens = args.soak_tokens
    machine = machine_info()
    if machine["idle_memory_pageout"]:
        print("warning: this machine pages out memory left idle (DAMON pageout); its kdamond "
              "runs beside the engines (batch tables: others' CPU %). To rule it out, as root "
              "pause it for the run: echo off > "
              "/sys/kernel/mm/damon/admin/kdamonds/<N>/state (see benchmarks/machine.py)",
              file=sys.stderr)
    window = f" (window {args.draft_window})" if args.draft_window else ""
    drafter = "draft" if args.method == "draft_model" else f"{args.method} head"
    title = (f"{Path(args.target).name} / {drafter} {Path(args.draft).name}{window}, {args.dtype}, "
             f"K={args.k}, {args.max_tokens} greedy tokens, {machine['cpu_count']} CPU cores "
             f"({machine['cpu_model']}, {machine['cpu_capability']}"
             f"{''.join(', ' + f for f in machine['cpu_bf16_flags'])})")
    started, commit = time.time(), git_commit()
    table, files = run_mode(args, out_dir, title)
    record_run(out_dir, mode=args.mode, description=MODES[args.mode], command=command,
               title=title, machine=machine, dtype=args.dtype, started=started, commit=commit)
    print(table)
    print(f"\nresults: {out_dir}/{files} and README.md")


if __name__ == "__main__":
    main()
