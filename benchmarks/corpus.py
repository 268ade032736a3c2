"""The long texts shipped with the project (``corpus/``), for prompts."""

from __future__ import annotations

import gzip
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parents[1] / "corpus" / "austen"


def read_text(path: Path) -> str:
    """A ``.txt`` or ``.txt.gz`` file as text."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def text_files(paths: list[Path]) -> list[Path]:
    """The text files of ``paths`` (folders expand to their sorted texts)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.name.endswith((".txt", ".txt.gz")))
        else:
            files.append(path)
    return files


def novel(name: str) -> str:
    """One novel of the shipped corpus, e.g. ``novel("persuasion")``."""
    return read_text(CORPUS_DIR / f"{name}.txt.gz")


def load_corpus(paths: list[Path]) -> str:
    """The texts of ``paths``, joined."""
    files = text_files(paths)
    if not files:
        raise SystemExit(f"no text files in {paths}")
    return "\n\n".join(read_text(f) for f in files)
