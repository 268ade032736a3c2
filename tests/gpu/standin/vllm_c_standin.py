"""Python stand-ins for the compiled vLLM ops a decode step reaches on CUDA.

Why: vLLM's compiled ops (``vllm/_C*.so``) are built against one torch (2.13
for vLLM 0.32) and cannot load beside another. Where a GPU machine has only
its own torch, vLLM's Python tree still runs if ``torch.ops._C*`` answers the
ops it calls. ``stage.sh`` installs this file as ``vllm/_C_stable_libtorch.py``,
the module vLLM's CUDA platform imports first to register its ops, so every
process that imports vLLM's CUDA platform registers these.

What it covers (engine tests on tiny models with ``custom_ops: ["none"]``
and the TRITON_ATTN backend): capability queries answer False (no CUTLASS,
no FP8/FP4 kernels), ``weak_ref_tensor`` returns a non-owning alias,
``get_cuda_view_from_cpu_tensor`` maps pinned host memory (UVA), the norm and
activation ops vLLM's IR layer prefers are torch, and the device attribute
queries read torch's device properties. Everything else stays missing: an
access to a missing ``_C`` op is logged once (``[standin] missing op``) so a
run tells which op stopped it. Not covered: FlashAttention (its own compiled
library), quantized kernels, custom all-reduce, MoE.
"""

from __future__ import annotations

import sys

import torch

NAMESPACE = "_C"
CUDA_UTILS_NAMESPACE = "_C_cuda_utils"

CAPABILITY_QUERIES = (
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_group_gemm_supported",
    "mxfp4_experts_quant_supported",
    "cutlass_sparse_scaled_mm_supported",
)
"""Queries ``(int cuda_device_capability) -> bool``: no CUTLASS kernels here."""


# ---- torch implementations (device-agnostic; tested on CPU) -----------------


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
             epsilon: float) -> None:
    out.copy_(_normalized(x, weight, epsilon))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       epsilon: float) -> None:
    """vLLM's contract: ``residual += x``; ``x = rms_norm(residual)``."""
    residual.add_(x)
    x.copy_(_normalized(residual, weight, epsilon))


def _normalized(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    y = y.to(x.dtype)
    return y if weight is None else y * weight


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    out.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])


def gelu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    out.copy_(torch.nn.functional.gelu(x[..., :d]) * x[..., d:])


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    out.copy_(torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:])


class _CudaArray:
    """``__cuda_array_interface__`` over raw bytes, keeping ``owner`` alive
    (None: a non-owning view)."""

    def __init__(self, pointer: int, num_bytes: int, owner: torch.Tensor | None) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,), "typestr": "|u1", "data": (pointer, False), "version": 3,
            "strides": None,
        }


def _byte_span(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _view_at(pointer: int, like: torch.Tensor, owner: torch.Tensor | None,
             device: torch.device) -> torch.Tensor:
    raw = torch.as_tensor(_CudaArray(pointer, _byte_span(like), owner), device=device)
    return raw.view(like.dtype).as_strided(like.shape, like.stride())


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory that does not keep it alive (vLLM's CUDA
    graph outputs); a plain alias off CUDA."""
    if t.device.type != "cuda" or t.numel() == 0:
        return t.detach()
    return _view_at(t.data_ptr(), t, None, t.device)


def get_cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """The device's view of pinned host memory: under unified virtual
    addressing a pinned (``cudaHostAlloc``) pointer is also its device pointer."""
    if not cpu_tensor.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor needs a pinned CPU tensor")
    device = torch.device("cuda", torch.cuda.current_device())
    return _view_at(cpu_tensor.data_ptr(), cpu_tensor, cpu_tensor, device)


def get_device_attribute(attribute: int, device: int) -> int:
    raise NotImplementedError(f"stand-in: cudaDeviceGetAttribute({attribute}) is not answered")


def get_max_shared_memory_per_block_device_attribute(device: int) -> int:
    return int(torch.cuda.get_device_properties(device).shared_memory_per_block_optin)


def _answers_false(cuda_device_capability: int) -> bool:
    return False


DECLARED_ONLY = (
    "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
    "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()",
    "silu_and_mul_quant(Tensor(a!) result, Tensor input, Tensor scale) -> ()",
    "silu_and_mul_per_block_quant(Tensor(a!) out, Tensor input, Tensor(b!) scales, int group_size, "
    "Tensor? scale_ub=None, bool is_scale_transposed=False) -> ()",
    "static_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor scale, "
    "int[]? group_shape=None) -> ()",
    "dynamic_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor(b!) scale) -> ()",
    "dynamic_per_token_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor(b!) scale, "
    "Tensor? scale_ub) -> ()",
    "rms_norm_static_fp8_quant(Tensor(a!) result, Tensor input, Tensor weight, Tensor scale, "
    "float epsilon) -> ()",
    "fused_add_rms_norm_static_fp8_quant(Tensor(a!) result, Tensor input, Tensor(b!) residual, "
    "Tensor weight, Tensor scale, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant(Tensor(a!) result, Tensor input, Tensor weight, "
    "Tensor(b!) scale, float epsilon, Tensor? scale_ub, Tensor(c!)? residual) -> ()",
    "fused_qk_norm_rope(Tensor(a!) qkv, int num_heads_q, int num_heads_k, int num_heads_v, "
    "int head_dim, float eps, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, "
    "bool is_neox, Tensor position_ids, int forced_token_heads_per_warp=-1) -> ()",
)
"""Ops vLLM's compilation passes name at import (``torch.ops._C.X.default``)
unguarded, with vLLM's schemas: defined so the modules import; calling one
raises (custom_ops ["none"] keeps rotary embedding in torch, and the rest are
quantized kernels the tests do not use)."""


def _not_implemented(name: str):
    def stand_in(*args, **kwargs):
        raise NotImplementedError(f"stand-in: vLLM's compiled op _C::{name} is not implemented")

    return stand_in


# ---- registration -----------------------------------------------------------

SCHEMAS = {
    "rms_norm": ("rms_norm(Tensor(a!) result, Tensor input, Tensor? weight, float epsilon) -> ()",
                 rms_norm),
    "fused_add_rms_norm": ("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, "
                           "Tensor? weight, float epsilon) -> ()", fused_add_rms_norm),
    "silu_and_mul": ("silu_and_mul(Tensor(a!) result, Tensor input) -> ()", silu_and_mul),
    "gelu_and_mul": ("gelu_and_mul(Tensor(a!) result, Tensor input) -> ()", gelu_and_mul),
    "gelu_tanh_and_mul": ("gelu_tanh_and_mul(Tensor(a!) result, Tensor input) -> ()",
                          gelu_tanh_and_mul),
    "weak_ref_tensor": ("weak_ref_tensor(Tensor input) -> Tensor", weak_ref_tensor),
    "get_cuda_view_from_cpu_tensor": ("get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor",
                                      get_cuda_view_from_cpu_tensor),
}
CUDA_UTILS_SCHEMAS = {
    "get_device_attribute": ("get_device_attribute(int attribute, int device_id) -> int",
                             get_device_attribute),
    "get_max_shared_memory_per_block_device_attribute": (
        "get_max_shared_memory_per_block_device_attribute(int device_id) -> int",
        get_max_shared_memory_per_block_device_attribute),
}
_LIBRARIES: list[torch.library.Library] = []
_MISSING: set[str] = set()


def register() -> list[str]:
    """Define every stand-in op not defined yet; returns the names defined.
    Ops with tensor arguments dispatch on every backend
    (CompositeExplicitAutograd); queries without any, implicitly."""
    defined = []
    table = {NAMESPACE: dict(SCHEMAS), CUDA_UTILS_NAMESPACE: dict(CUDA_UTILS_SCHEMAS)}
    table[NAMESPACE].update({name: (f"{name}(int cuda_device_capability) -> bool",
                                     _answers_false) for name in CAPABILITY_QUERIES})
    for schema in DECLARED_ONLY:
        name = schema.split("(", 1)[0]
        table[NAMESPACE][name] = (schema, _not_implemented(name))
    for namespace, ops in table.items():
        library = torch.library.Library(namespace, "FRAGMENT")
        _LIBRARIES.append(library)
        for name, (schema, function) in ops.items():
            if hasattr(getattr(torch.ops, namespace), name):
                continue
            library.define(schema)
            key = "CompositeExplicitAutograd" if "Tensor" in schema else "CompositeImplicitAutograd"
            library.impl(name, function, key)
            defined.append(f"{namespace}::{name}")
    _log_missing_ops()
    return defined


def _log_missing_ops() -> None:
    """Log (once per name) every access to an op of vLLM's namespaces that no
    library defines: the first one a run reaches is what stopped it."""
    namespace_type = type(torch.ops._C)
    if getattr(namespace_type, "_standin_logging", False):
        return
    original = namespace_type.__getattr__

    def __getattr__(self, name):
        try:
            return original(self, name)
        except AttributeError:
            qualified = f"{self.name}::{name}"
            if self.name.startswith(("_C", "_moe_C")) and qualified not in _MISSING:
                _MISSING.add(qualified)
                print(f"[standin] missing op {qualified}", file=sys.stderr, flush=True)
            raise

    namespace_type.__getattr__ = __getattr__
    namespace_type._standin_logging = True


def missing_ops() -> list[str]:
    return sorted(_MISSING)

