"""Shared by every benchmark report: the results folder, number formatting,
one colour per configuration in every figure, and figure saving."""

from __future__ import annotations

import textwrap
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def args_record(args) -> dict:
    """A run's command-line arguments as JSON values (paths as strings)."""
    def plain(value):
        if isinstance(value, list):
            return [plain(v) for v in value]
        return str(value) if isinstance(value, Path) else value

    return {k: plain(v) for k, v in vars(args).items()}


def fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


CONFIG_COLORS = {"target": "tab:gray", "target_sync": "black", "draft_model": "tab:blue",
                 "cmr": "tab:red", "streaming": "tab:green", "draft_model_full": "tab:purple",
                 "ngram": "tab:brown", "cmr_k_by_batch": "tab:orange",
                 "goodput": "tab:cyan", "always_paused": "lightseagreen",
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
        # About 12 characters per inch of figure at the default font size.
        fig.suptitle(textwrap.fill(title, int(12 * fig.get_figwidth())))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
