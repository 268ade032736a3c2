"""How fast a process reads its memory on 4 KiB pages and on transparent huge
pages (torch's ``THP_MEM_ALLOC_ENABLE`` and glibc's ``glibc.malloc.hugetlb``,
as ``python -m benchmarks`` sets them for its engines): decode on a CPU reads every weight
each step, so this is the speed a target forward can reach.

Each of ``--processes`` fresh processes per setting allocates two buffers of
``--gib`` GiB (float32) and reads them in turn, ``--reads`` times each; a
buffer's speed is the median of its reads. Where the pages land decides the
speed on 4 KiB pages; the two buffers of one process show it at one time.

    python -m benchmarks.huge_pages --out benchmarks/results/huge-pages
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median_high

from benchmarks.machine import HUGE_PAGES_FOR_MALLOC, HUGE_PAGES_FOR_TORCH, cpu_model

SETTINGS = {
    "4 KiB pages": {HUGE_PAGES_FOR_TORCH: "0", "GLIBC_TUNABLES": ""},
    "huge pages": {HUGE_PAGES_FOR_TORCH: "1", "GLIBC_TUNABLES": HUGE_PAGES_FOR_MALLOC},
}
"""Label: the measuring process's environment."""
COLOURS = {"4 KiB pages": "tab:red", "huge pages": "tab:blue"}


def read_speeds(gib: float, reads: int) -> list[list[float]]:
    """GB/s of every read of each of two buffers, read in turn."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    numel = int(gib * (1 << 30)) // 4
    buffers = [torch.ones(numel, dtype=torch.float32) for _ in range(2)]
    for buffer in buffers:
        buffer.sum()
    speeds: list[list[float]] = [[], []]
    for _ in range(reads):
        for index, buffer in enumerate(buffers):
            start = time.perf_counter()
            buffer.sum()
            speeds[index].append(numel * 4 / (time.perf_counter() - start) / 1e9)
    return speeds


def measure(gib: float, reads: int, processes: int) -> dict[str, list[list[list[float]]]]:
    """Per setting, per process, each buffer's reads (GB/s)."""
    runs: dict[str, list] = {}
    for label, environment in SETTINGS.items():
        for index in range(processes):
            print(f"{label}: process {index + 1}/{processes}", flush=True)
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.huge_pages", "--child",
                 "--gib", str(gib), "--reads", str(reads)],
                env={**os.environ, **environment},
                capture_output=True, text=True, check=True).stdout
            runs.setdefault(label, []).append(json.loads(out.splitlines()[-1]))
    return runs


def write(runs: dict, args, out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import git_commit

    out_dir.mkdir(parents=True, exist_ok=True)
    system_mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    cpu, commit = cpu_model()[0], git_commit()
    result = {"gib": args.gib, "reads": args.reads, "processes": args.processes,
              "cpu": cpu, "cores": os.cpu_count(), "system_thp": system_mode,
              "commit": commit, "runs": runs}
    (out_dir / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"Read speed (GB/s, median of {args.reads} reads) of two {args.gib:g} GiB buffers "
             f"per process, {cpu}, {os.cpu_count()} cores, system THP `{system_mode}`, "
             f"commit {commit}.", "",
             "| pages | process | buffer 1 | buffer 2 | buffer 2 / 1 |",
             "|---|---:|---:|---:|---:|"]
    summary = []
    for label, processes in runs.items():
        all_buffers = []
        for index, (first, second) in enumerate(processes):
            a, b = median_high(first), median_high(second)
            all_buffers += [a, b]
            lines.append(f"| {label} | {index + 1} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
        summary.append(f"| {label} | {min(all_buffers):.1f} | {max(all_buffers):.1f} | "
                       f"{max(all_buffers) / min(all_buffers):.2f} |")
    lines += ["", "| pages | slowest buffer | fastest buffer | fastest / slowest |",
              "|---|---:|---:|---:|", *summary]
    table = "\n".join(lines) + "\n"
    (out_dir / "results.md").write_text(table)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, processes in runs.items():
        for buffer in (0, 1):
            xs = [index + 1 + (buffer - 0.5) * 0.2 for index in range(len(processes))]
            ax.scatter(xs, [median_high(p[buffer]) for p in processes], color=COLOURS[label],
                       marker="o" if buffer == 0 else "s",
                       label=f"{label}, buffer {buffer + 1}")
    ax.set_xlabel("process")
    ax.set_ylabel("read GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{args.gib:g} GiB buffers, {cpu}, {os.cpu_count()} cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "results.png", dpi=120)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.0)
    parser.add_argument("--reads", type=int, default=6)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/huge-pages"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(read_speeds(args.gib, args.reads)))
        return
    print(write(measure(args.gib, args.reads, args.processes), args, args.out))


if __name__ == "__main__":
    main()
