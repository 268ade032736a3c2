"""Command line of the benchmarks against stock vLLM on the real models.

    python -m benchmarks                                 # single requests (runs.py)
    python -m benchmarks --batch-sizes 1 4 8             # batches (batch.py)
    python -m benchmarks --serve --concurrency 8         # vllm serve (serve.py)
    python -m benchmarks --sweep | --needle              # sweep.py, needle.py
    python -m benchmarks --refresh                       # refresh.py
    python -m benchmarks --soak                          # soak.py (served, 30 min)
    python -m benchmarks --document-qa                   # document_qa.py
    python -m benchmarks --k-trace                       # k_trace.py
    python -m benchmarks --eagle3                        # eagle3_long.py (EAGLE-3 head)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.corpus import CORPUS_DIR
from benchmarks.machine import fast_dtype, machine_info
from benchmarks.needle import run_needle, write_needle
from benchmarks.report import RESULTS_DIR
from benchmarks.runs import run_benchmark, write_results
from benchmarks.sweep import run_sweep, write_sweep


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="local path, hub id, or a short name from benchmarks.real_models")
    parser.add_argument("--draft", default=None,
                        help="the draft model (default qwen2.5-coder-0.5b), or with --method "
                             "eagle/eagle3 the EAGLE head (--eagle3: default the head "
                             "scripts/make_eagle_head.sh trains)")
    parser.add_argument("--method", default="draft_model",
                        choices=["draft_model", "eagle", "eagle3"],
                        help="speculative method of --draft; the draft_model configuration "
                             "is stock drafting with it")
    parser.add_argument("--heterogeneous-vocab", action="store_true",
                        help="draft with its own tokenizer (use_heterogeneous_vocab)")
    parser.add_argument("--corpus", type=Path, nargs="+", default=None,
                        help="texts or folders of texts (default the shipped corpus; "
                             "--eagle3: the novel the head's training held out)")
    parser.add_argument("--offset", type=int, default=100_000,
                        help="character offset of the passages in the corpus")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="context lengths (default 1024 4096 8192; --sweep: 4096 8192; "
                             "--eagle3: 1024 4096 8192 16384; --soak: the long prompts, "
                             "4096 8192 16384)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=None,
                        help="num_speculative_tokens (default 4; --eagle3: the head's "
                             "training-time test depth)")
    parser.add_argument("--draft-window", type=int, default=None,
                        help="cap the draft's window (speculative_config max_model_len) in "
                             "every draft configuration but draft_model_full (--soak: "
                             "default 2048, compact positions)")
    parser.add_argument("--configs", nargs="+", default=None,
                        help="default target, draft_model, cmr, streaming; batched and "
                             "served modes "
                             "also goodput (cmr with speculation_control goodput), "
                             "always_paused (batched: goodput forced to pause every "
                             "request, its floor on the same engine), target_sync (the "
                             "target alone, synchronous scheduler) and "
                             "cmr_k_by_batch (vLLM's K-by-batch-size schedule); single "
                             "requests also draft_model_full, ngram; --eagle3: target, "
                             "eagle3_full, eagle3_sliding, cmr, streaming, goodput (all by "
                             "default)")
    parser.add_argument("--spec-extend", default=None,
                        help="JSON spec_extend options for cmr/streaming (defaults otherwise)")
    parser.add_argument("--dtype", default="auto",
                        help="model dtype; auto: bfloat16 where this CPU has fast bf16 "
                             "matmuls (AVX-512 BF16/AMX, or a GPU), else float32")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--kv-cache-gib", type=int, default=3)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="enforce_eager (torch.compile start-up is slow on 2 cores)")
    parser.add_argument("--sweep", action="store_true",
                        help="run the option sweep (defaults: 4K and 8K) instead")
    parser.add_argument("--sweep-points", default=None,
                        help="JSON list of option dicts to sweep instead of the built-in "
                             "points, each applied on top of --spec-extend")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="batched mode: N passages per LLM.generate call for each N "
                             "(benchmarks/batch.py), e.g. --batch-sizes 1 4 8")
    parser.add_argument("--serve", action="store_true",
                        help="served mode: vllm serve per configuration, measured with "
                             "vllm bench serve (benchmarks/serve.py)")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="served mode: prompts and --max-concurrency")
    parser.add_argument("--needle", action="store_true",
                        help="run the needle-retrieval benchmark instead")
    parser.add_argument("--needle-length", type=int, default=4096)
    parser.add_argument("--needle-tokens", type=int, default=12)
    parser.add_argument("--document-qa", action="store_true",
                        help="questions on one cached document (the first --lengths, "
                             "--concurrency questions): cmr at compact positions alone, "
                             "batched with private layouts, in place and without prefix "
                             "caching (benchmarks/document_qa.py; default --draft-window "
                             "2048)")
    parser.add_argument("--soak", action="store_true",
                        help="served soak: vllm serve with cmr and compact positions under "
                             "a mixed load with faults, then every completed request "
                             "replayed alone (benchmarks/soak.py; default float32)")
    parser.add_argument("--soak-minutes", type=float, default=30)
    parser.add_argument("--soak-tokens", type=int, default=32,
                        help="greedy tokens per soak request")
    parser.add_argument("--soak-replay-minutes", type=float, default=15,
                        help="time for replaying the soak's completed requests alone")
    parser.add_argument("--refresh", action="store_true",
                        help="run the retrieval-refresh benchmark (fixed interval against "
                             "acceptance drops) instead")
    parser.add_argument("--refresh-length", type=int, default=4096)
    parser.add_argument("--refresh-tokens", type=int, default=320,
                        help="tokens generated for each two-paragraph copy")
    parser.add_argument("--k-trace", action="store_true",
                        help="goodput control's drafts per request and step, for one batch "
                             "of --lengths (one request each), instead")
    parser.add_argument("--eagle3", action="store_true",
                        help="an EAGLE-3 head on long inputs (stock full attention, sliding "
                             "window, cmr, streaming, goodput; default --batch-sizes 1 4) "
                             "instead")
    parser.add_argument("--rounds", type=int, default=1,
                        help="--eagle3 / batches: open every engine at once and run each "
                             "point this many times, the engines taking turns; report each "
                             "configuration's median round (for hosts whose speed drifts; "
                             "needs memory for all engines)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="--eagle3: leave out batches of more prompt tokens than this "
                             "(the smallest batch always runs)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default=None,
                        help="results folder under benchmarks/results "
                             "(default: main, sweep, needle, refresh, k-trace, eagle3, batch "
                             "or serve)")
    args = parser.parse_args(argv)
    if args.eagle3:
        args.method = "eagle3"
        args.batch_sizes = args.batch_sizes or [1, 4]
        args.configs = args.configs or ["target", "eagle3_full", "eagle3_sliding", "cmr",
                                        "streaming", "goodput"]
    args.configs = args.configs or ["target", "draft_model", "cmr", "streaming"]
    args.lengths = args.lengths or (
        [4096, 8192] if args.sweep else [1024, 4096, 8192, 16384] if args.eagle3
        else [4096, 8192, 16384] if args.soak else [8192] if args.document_qa
        else [1024, 4096, 8192])
    if args.soak or args.document_qa:
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


def main(argv=None) -> None:
    args = parse_args(argv)
    from benchmarks.real_models import resolve_model

    args.target = resolve_model(args.target)
    if args.eagle3:
        from benchmarks.eagle_head import HELD_OUT_NOVEL, default_head_dir, head_draft_length

        args.draft = args.draft or str(default_head_dir(args.target))
        args.corpus = args.corpus or [CORPUS_DIR / f"{HELD_OUT_NOVEL}.txt.gz"]
        args.k = args.k or head_draft_length(args.draft)
    args.draft = resolve_model(args.draft or "qwen2.5-coder-0.5b")
    args.corpus = args.corpus or [CORPUS_DIR]
    args.k = args.k or 4
    if args.soak:
        # Batched and solo outputs are compared token for token: float32.
        args.dtype = "float32" if args.dtype == "auto" else args.dtype
    if args.dtype == "auto":
        args.dtype = fast_dtype()
    # Slow CPUs can spend minutes on one long prefill step; vLLM's default
    # step timeout (300 s) would kill the engine.
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    use_all_cores()
    name = args.name or ("sweep" if args.sweep else "eagle3" if args.eagle3
                         else "needle" if args.needle else "soak" if args.soak
                         else "document-qa" if args.document_qa
                         else "refresh" if args.refresh else "k-trace" if args.k_trace
                         else "batch" if args.batch_sizes else "serve" if args.serve
                         else "main")
    out_dir = args.out or RESULTS_DIR / name
    if args.refresh:
        args.max_tokens = args.refresh_tokens  # the longest answer, in the title
    if args.soak:
        args.max_tokens = args.soak_tokens
    machine = machine_info()
    window = f" (window {args.draft_window})" if args.draft_window else ""
    drafter = "draft" if args.method == "draft_model" else f"{args.method} head"
    title = (f"{Path(args.target).name} / {drafter} {Path(args.draft).name}{window}, {args.dtype}, "
             f"K={args.k}, {args.max_tokens} greedy tokens, {machine['cpu_count']} CPU cores "
             f"({machine['cpu_model']}, {machine['cpu_capability']}"
             f"{''.join(', ' + f for f in machine['cpu_bf16_flags'])})")
    if args.eagle3:
        from benchmarks.eagle3_long import run_eagle3, write_eagle3

        print(write_eagle3(run_eagle3(args), out_dir, title))
        print(f"\nresults: {out_dir}/eagle3.{{json,md,png}}")
        return
    if args.sweep:
        print(write_sweep(run_sweep(args), out_dir, title))
        print(f"\nresults: {out_dir}/sweep.{{json,md}}")
        return
    if args.serve:
        from benchmarks.serve import run_serve, write_serve

        args.out = out_dir
        print(write_serve(run_serve(args), out_dir, title))
        print(f"\nresults: {out_dir}/results.{{json,md,png}}")
        return
    if args.batch_sizes:
        from benchmarks.batch import run_batch, write_batch

        print(write_batch(run_batch(args), out_dir, title))
        print(f"\nresults: {out_dir}/results.{{json,md,png}}")
        return
    if args.k_trace:
        from benchmarks.k_trace import run_k_trace, write_k_trace

        print(write_k_trace(run_k_trace(args), out_dir, title))
        print(f"\nresults: {out_dir}/k_trace.{{json,md,png}}")
        return
    if args.refresh:
        from benchmarks.refresh import run_refresh, write_refresh

        print(write_refresh(run_refresh(args), out_dir, title))
        print(f"\nresults: {out_dir}/refresh.{{json,md,png}}")
        return
    if args.document_qa:
        from benchmarks.document_qa import run_document_qa, write_document_qa

        print(write_document_qa(run_document_qa(args), out_dir, title))
        print(f"\nresults: {out_dir}/document_qa.{{json,md,png}}")
        return
    if args.soak:
        from benchmarks.soak import run_soak, write_soak

        args.out = out_dir
        print(write_soak(run_soak(args), out_dir, title))
        print(f"\nresults: {out_dir}/soak.{{json,md,png}}")
        return
    if args.needle:
        print(write_needle(run_needle(args), out_dir))
        print(f"\nresults: {out_dir}/needle.{{json,md,png}}")
        return
    table = write_results(run_benchmark(args), out_dir, title)
    print(table)
    print(f"\nresults: {out_dir}/results.{{json,md,png}}")


if __name__ == "__main__":
    main()
