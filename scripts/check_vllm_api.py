"""Check a vLLM release's Python sources for every name vllm-specextend uses
(``vllm_specextend/vllm_api/``), without installing or importing it.

    pip download --no-deps vllm==0.33.0 -d /tmp/vllm033
    python scripts/check_vllm_api.py /tmp/vllm033/vllm-0.33.0-*.whl

SOURCE is a wheel (only its ``vllm/**.py`` are read), a directory holding
``vllm/`` (e.g. a site-packages), or omitted for the installed vLLM. Exits 1
when an expectation is unmet.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_specextend.vllm_api import (  # noqa: E402
    VllmSources,
    absent_optional,
    check,
    format_report,
    source_version,
)


def installed_vllm_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("no vLLM installed: pass a wheel or a source directory")
    return Path(spec.origin).resolve().parents[1]


def extract_sources(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        archive.extractall(into, names)
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/check_vllm_api.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", type=Path,
                        help="a vLLM wheel or a directory holding vllm/ (default: installed)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        root = args.source or installed_vllm_root()
        if root.is_file():
            root = extract_sources(root, Path(scratch))
        if not (root / "vllm").is_dir():
            raise SystemExit(f"{root} holds no vllm/ package")
        sources = VllmSources(root)
        problems = check(sources)
        print(format_report(problems, args.source or root, source_version(root),
                            absent_optional(sources)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
