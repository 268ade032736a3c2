"""The stand-in for vLLM's compiled CUDA ops (``tests/gpu/standin``), on CPU:
its torch ops against references, and the CUDA path's modules importing
with it (what the GPU engine tests need before they can start)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STANDIN = Path(__file__).resolve().parent / "gpu" / "standin"
REPO = STANDIN.parents[2]


def run_python(code: str, **env: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, cwd=REPO, env={**os.environ, **env}, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_the_stand_in_ops_match_torch_references():
    """In a process without vLLM (whose CPU build defines some of these ops)."""
    out = run_python(f"""
        import sys, torch
        sys.path.insert(0, {str(STANDIN)!r})
        import vllm_c_standin as standin
        standin.register()
        ops = torch.ops._C
        for dtype in (torch.float32, torch.bfloat16):
            x, r, w = (torch.randn(5, 64, dtype=dtype) for _ in range(3))
            w = w[0]
            def norm(v):
                v32 = v.float()
                return (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w
            out = torch.empty_like(x)
            ops.rms_norm(out, x, w, 1e-6)
            assert torch.equal(out, norm(x))
            x2, r2 = x.clone(), r.clone()
            ops.fused_add_rms_norm(x2, r2, w, 1e-6)
            assert torch.equal(r2, x + r) and torch.equal(x2, norm(x + r))
            half = torch.empty(5, 32, dtype=dtype)
            for op, act in ((ops.silu_and_mul, torch.nn.functional.silu),
                            (ops.gelu_and_mul, torch.nn.functional.gelu),
                            (ops.gelu_tanh_and_mul,
                             lambda v: torch.nn.functional.gelu(v, approximate="tanh"))):
                op(half, x)
                assert torch.equal(half, act(x[:, :32]) * x[:, 32:])
        assert ops.cutlass_scaled_mm_supports_block_fp8(90) is False
        alias = ops.weak_ref_tensor(x)
        assert alias.data_ptr() == x.data_ptr() and torch.equal(alias, x)
        try:
            ops.rotary_embedding(x, x, None, 64, x, True)
        except NotImplementedError as e:
            print("declared only:", e)
        else:
            raise AssertionError("a declared-only op ran")
        assert not hasattr(ops, "no_such_op")
        print("missing:", standin.missing_ops())
    """)
    assert "declared only" in out and "missing: ['_C::no_such_op']" in out


@pytest.mark.engine
def test_the_cuda_paths_modules_import_with_the_stand_in(tmp_path):
    """vLLM's CUDA platform, runners, drafters and compilation passes and our
    adapters import from the staged tree (no compiled vLLM ops) with CUDA as
    vLLM's platform. Failed before the stand-in declared the ops vLLM's
    fusion passes name at import (``_C::rotary_embedding``, ...), as the
    first GPU run did."""
    import vllm

    sys.path.insert(0, str(STANDIN))
    try:
        from stage_tree import write_tree
    finally:
        sys.path.remove(str(STANDIN))
    write_tree(Path(vllm.__file__).parents[1], tmp_path)
    # vLLM turns Triton off on a machine without a GPU driver.
    with (tmp_path / "vllm" / "triton_utils" / "importing.py").open("a") as f:
        f.write("\nHAS_TRITON = True\n")
    out = run_python(f"import runpy; runpy.run_path({str(STANDIN / 'import_check.py')!r}, "
                     "run_name='__main__')", PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    assert "25 of 25 modules import" in out, out
