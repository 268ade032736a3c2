"""Shared by every benchmark report: the results folders, each run's README
(command, commit, machine, dtype, date), number formatting, one colour per
configuration in every figure, and figure saving."""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Published results, one folder per current result, indexed in benchmarks/README.md."""

LOCAL_RESULTS_DIR = Path(__file__).resolve().parent / "results-local"
"""Where new runs go by default; git ignores it, so a run never overwrites a
published result."""

REPO_ROOT = Path(__file__).resolve().parent.parent


def args_record(args) -> dict:
    """A run's command-line arguments as JSON values (paths as strings)."""
    def plain(value):
        if isinstance(value, list):
            return [plain(v) for v in value]
        return str(value) if isinstance(value, Path) else value

    return {k: plain(v) for k, v in vars(args).items()}


def fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


def fmt_ratio(value, spec=".2f"):
    """A ratio as ``1.23x``; ``-`` when it is missing."""
    return "-" if value is None else format(value, spec) + "x"


def git_commit(repo: Path = REPO_ROOT) -> str:
    """The checked-out commit, marked when tracked files have changes;
    ``SPECEXTEND_COMMIT`` where the tree is a copy without ``.git`` (a lent
    GPU machine)."""
    if os.environ.get("SPECEXTEND_COMMIT"):
        return os.environ["SPECEXTEND_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                              text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{commit} with uncommitted changes" if dirty else commit


def machine_line(machine: dict[str, Any]) -> str:
    flags = "".join(f", {flag}" for flag in machine.get("cpu_bf16_flags", []))
    gpu = ", CUDA available" if machine.get("cuda") else ", no GPU"
    pages = ", huge pages" if machine.get("huge_pages") else ""
    if machine.get("idle_memory_pageout"):
        pages += ", idle memory paged out (DAMON)"
    return (f"{machine.get('cpu_model', machine.get('processor'))}, "
            f"{machine.get('cpu_count')} cores ({machine.get('cpu_capability')}{flags}){gpu}"
            f"{pages}; "
            f"vLLM {machine.get('vllm')}, torch {machine.get('torch')}")


def record_run(out_dir: Path, *, mode: str, description: str, command: str, title: str,
               machine: dict[str, Any], dtype: str, started: float, commit: str) -> None:
    """Write the run's README.md and sign every table it wrote with its
    command and commit (``started``, ``commit``: read when the run started,
    :func:`git_commit`, so a run that outlives a commit names the code it ran)."""
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    minutes = (time.time() - started) / 60
    signature = f"Command: `{command}` · commit {commit} · {date}"
    for table in sorted(out_dir.glob("*.md")):
        if table.name != "README.md" and table.stat().st_mtime >= started - 1:
            with table.open("a") as f:
                f.write(f"\n{signature}\n")
    files = ", ".join(sorted(f.name for f in out_dir.iterdir()
                             if f.is_file() and f.name != "README.md"))
    (out_dir / "README.md").write_text(
        f"# {out_dir.name}: {mode}\n\n"
        f"{description[0].upper() + description[1:]}.\n\n"
        f"- command: `{command}`\n"
        f"- commit: {commit}\n"
        f"- machine: {machine_line(machine)}\n"
        f"- dtype: {dtype}\n"
        f"- date: {date} ({minutes:.0f} min)\n"
        f"- setting: {title}\n"
        f"- files: {files}\n\n"
        "Reading: (one line, written when the run is published under benchmarks/results "
        "and indexed in benchmarks/README.md)\n")


CONFIG_COLORS = {"target": "tab:gray", "target_sync": "black", "target_v1": "silver",
                 "draft_model": "tab:blue",
                 "cmr": "tab:red", "streaming": "tab:green", "draft_model_full": "tab:purple",
                 "ngram": "tab:brown", "ngram_no_match": "sienna", "cmr_k_by_batch": "tab:orange",
                 "goodput": "tab:cyan", "always_paused": "mediumvioletred",
                 "cmr_every_16": "tab:pink", "cmr_on_drops": "goldenrod", "eagle3_full": "navy",
                 "eagle3_sliding": "darkkhaki", "alone": "dimgray", "private": "firebrick",
                 "in_place": "sandybrown", "unshared": "steelblue"}


def config_color(config: str) -> str:
    """One colour per configuration, the same in every figure."""
    return CONFIG_COLORS.get(config, "tab:olive")


def pyplot():
    """matplotlib's pyplot on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, title: str | None = None) -> None:
    if title:
        # About 10 characters per inch of figure at the suptitle's font size.
        fig.suptitle(textwrap.fill(title, int(10 * fig.get_figwidth())))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
