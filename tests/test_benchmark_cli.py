"""The benchmarks' command line: one mode per run, the folder it writes named
after the mode that ran, and each run's README (no engine starts here)."""

from __future__ import annotations

import subprocess
import time

import pytest

from benchmarks.cli import MODES, build_parser, parse_args
from benchmarks.report import LOCAL_RESULTS_DIR, REPO_ROOT, fmt_ratio, git_commit, record_run


@pytest.mark.parametrize("argv, mode", [
    ([], "single"),
    (["--batch-sizes", "1", "4"], "batch"),
    (["--serve"], "serve"),
    (["--eagle3", "--batch-sizes", "2"], "eagle3"),
    (["--document-qa"], "document-qa"),
    (["--k-trace"], "k-trace"),
])
def test_one_mode_per_run(argv, mode):
    assert parse_args(argv).mode == mode


@pytest.mark.parametrize("argv", [
    ["--serve", "--sweep"],
    ["--serve", "--batch-sizes", "8"],  # it served and wrote into results/batch
    ["--needle", "--batch-sizes", "1"],
])
def test_conflicting_modes_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_names_the_program_every_mode_and_the_defaults():
    help_text = build_parser().format_help()
    assert help_text.startswith("usage: python -m benchmarks")
    for mode in MODES:
        if mode not in ("single", "batch"):
            assert f"--{mode}" in help_text
    assert "(default: 3)" in help_text  # --kv-cache-gib
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"


def test_new_runs_go_to_an_ignored_folder():
    assert LOCAL_RESULTS_DIR.parent == REPO_ROOT / "benchmarks"
    ignored = subprocess.run(["git", "-C", str(REPO_ROOT), "check-ignore", "-q",
                              str(LOCAL_RESULTS_DIR / "batch" / "results.json")])
    assert ignored.returncode == 0


def test_a_run_records_its_command_and_commit(tmp_path):
    started = time.time()
    (tmp_path / "results.md").write_text("| a | b |\n|---|---|\n| 1 | - |\n")
    (tmp_path / "results.json").write_text("{}")
    machine = {"cpu_model": "Test CPU", "cpu_count": 2, "cpu_capability": "AVX2",
               "cpu_bf16_flags": [], "cuda": False, "vllm": "0.32.0", "torch": "2.13.0"}
    record_run(tmp_path, mode="batch", description=MODES["batch"],
               command="python -m benchmarks --batch-sizes 1", title="tiny",
               machine=machine, dtype="float32", started=started, commit=git_commit())
    readme = (tmp_path / "README.md").read_text()
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    for expected in ("`python -m benchmarks --batch-sizes 1`", commit, "Test CPU, 2 cores",
                     "dtype: float32", time.strftime("%Y-%m-%d", time.gmtime(started)),
                     "results.json, results.md"):
        assert expected in readme
    table = (tmp_path / "results.md").read_text()
    assert f"`python -m benchmarks --batch-sizes 1` · commit {commit}" in table
    # A run signs with the commit it started from, even if HEAD moved meanwhile.
    (tmp_path / "results.md").write_text("| a |\n|---|\n| 1 |\n")
    record_run(tmp_path, mode="batch", description=MODES["batch"], command="python -m benchmarks",
               title="tiny", machine=machine, dtype="float32", started=started,
               commit="abc1234 with uncommitted changes")
    assert "- commit: abc1234 with uncommitted changes\n" in (tmp_path / "README.md").read_text()
    assert "· commit abc1234 with uncommitted changes" in (tmp_path / "results.md").read_text()


def test_missing_ratios_print_as_a_dash():
    assert fmt_ratio(None) == "-"
    assert fmt_ratio(1.234) == "1.23x"

