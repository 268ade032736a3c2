"""A dispatch mode that finds host syncs without a GPU.

Device tensors live on the ``meta`` device and host tensors on the CPU; every
aten op passes through :class:`HostSyncCheck`, which records (and, where the
op cannot run on meta, raises at) any op that on CUDA would make the host
wait for the device or copy host memory synchronously:

- ops that need a device value on the host: ``_local_scalar_dense`` /
  ``item`` (``int()``, ``float()``, ``.tolist()``), ``is_nonzero``
  (``bool()``, ``if tensor:``), ``equal``, and the ops whose output size
  depends on values: ``nonzero``, ``masked_select``, ``unique*``,
  ``bincount``, ``repeat_interleave`` without ``output_size``, and indexing
  (read or write) with a boolean mask;
- copies from the device to the host;
- host memory mixed into device work: a CPU tensor given to a device op
  (``cat``, ``index_put_``, ``index_select``...), except a 0-dim CPU tensor
  in a pointwise op (CUDA reads it on the host as a kernel argument);
- a Python scalar written through a device index (``t[idx] = 0.0``): on CUDA
  ``__setitem__`` keeps the scalar on the host and ``index_put_`` copies it
  to the device with a blocking copy (on meta it is made on meta, so the
  check tracks the scalars ``__setitem__`` makes);
- copies from host memory to the device that are not ``non_blocking`` from a
  staging buffer (``common.staging.is_staging_memory``: pinned, or allocated
  by ``host_staging_buffer`` where nothing can be pinned): a
  ``non_blocking`` copy from pageable memory is synchronous on CUDA;
- ``torch.tensor(data, device=...)`` / ``torch.as_tensor`` to the device
  (patched while the mode is on: the copy inside is invisible to dispatch).

An op is allowed when a frame of its Python stack is in ``allow`` (set-up,
metrics pulls), as ``"module:qualname"``; :attr:`HostSyncCheck.allowed`
counts what each entry let through, and an allowed read that meta cannot
answer gets zeros (so a metrics pull completes). ``int()`` / ``.item()`` of a
meta tensor raise before dispatch: a test fails on them all the same.

What this cannot see: syncs inside CUDA-only code (Triton kernels, CUDA
graphs, custom ops that do not run on meta), and ops that run on the host
while the device is idle (host time: ``benchmarks/host_time.py``).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vllm_specextend.common.staging import is_staging_memory

aten = torch.ops.aten

NEEDS_A_HOST_VALUE = {
    aten._local_scalar_dense.default: "reads a device value on the host (.item(), int(), .tolist())",
    aten.is_nonzero.default: "bool() of a device tensor",
    aten.equal.default: "torch.equal returns a host bool",
    aten.nonzero.default: "nonzero: output size depends on values",
    aten.argwhere.default: "argwhere: output size depends on values",
    aten.masked_select.default: "masked_select: output size depends on values",
    aten._unique.default: "unique: output size depends on values",
    aten._unique2.default: "unique: output size depends on values",
    aten.unique_dim.default: "unique: output size depends on values",
    aten.unique_consecutive.default: "unique_consecutive: output size depends on values",
    aten.bincount.default: "bincount: output size depends on values",
}

_INDEX_OPS = {
    aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
    aten._index_put_impl_.default,
}
_INDEX_PUT_OPS = _INDEX_OPS - {aten.index.Tensor}
_COPY_TO_DEVICE_OPS = {aten._to_copy.default, aten.copy_.default}


class HostSyncError(AssertionError):
    """An op that waits for the device or copies host memory synchronously."""


@dataclass(frozen=True)
class Violation:
    reason: str
    op: str
    site: str
    """The innermost ``vllm_specextend`` frame (file:line in function)."""

    def __str__(self) -> str:
        return f"{self.site}: {self.op}: {self.reason}"


class HostSyncCheck(TorchDispatchMode):
    """Records every host sync while on (see the module docstring)."""

    def __init__(self, allow: set[str] = frozenset()) -> None:
        super().__init__()
        self.allow = set(allow)
        self.allowed: Counter[str] = Counter()
        self.violations: list[Violation] = []
        self._python_scalars: dict[int, torch.Tensor] = {}
        self._patched: dict[str, object] = {}

    # ---- the mode ---------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = self._host_sync(func, args, kwargs)
        allowed = reason is not None and self._report(reason, str(func))
        try:
            out = func(*args, **kwargs)
        except Exception as error:
            if reason is None:
                raise
            if allowed:
                # Meta holds no values: an allowed read gets zeros.
                return _stand_in_for_a_host_read(func, args, kwargs, error)
            raise HostSyncError(self.summary()) from error
        if func is aten.scalar_tensor.default and _device_type(kwargs.get("device")) == "meta":
            # What __setitem__ makes of a Python scalar (on CUDA: a CPU tensor).
            self._python_scalars[id(out)] = out
        return out

    def _host_sync(self, func, args, kwargs) -> str | None:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type == "meta"]
        if func in NEEDS_A_HOST_VALUE:
            return NEEDS_A_HOST_VALUE[func] if on_device else None
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            return ("repeat_interleave without output_size: output size depends on values"
                    if on_device else None)
        if func in _INDEX_OPS and on_device:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                return "boolean-mask indexing: output size depends on values (use torch.where)"
        if func in _INDEX_PUT_OPS:
            values = args[2] if len(args) > 2 else kwargs.get("values")
            if id(values) in self._python_scalars:
                return ("a Python scalar written through a device index: a blocking copy on "
                        "CUDA (use index_fill_ / masked_fill_)")
        if func is aten.copy_.default and id(args[1]) in self._python_scalars \
                and args[0].dim() == 0:
            return "a Python scalar written into one device element: a blocking copy on CUDA"
        if func in _COPY_TO_DEVICE_OPS:
            return self._copy_sync(func, args, kwargs)
        on_host = [t for t in tensors if t.device.type == "cpu"]
        if not on_device or not on_host:
            return None
        if all(t.dim() == 0 for t in on_host) and torch.Tag.pointwise in func.tags:
            return None  # a host scalar operand: a kernel argument on CUDA
        return "host memory in a device op (on CUDA: a blocking copy, or an error)"

    @staticmethod
    def _copy_sync(func, args, kwargs) -> str | None:
        if func is aten._to_copy.default:
            source, target_type = args[0], _device_type(kwargs.get("device"))
            non_blocking = kwargs.get("non_blocking", False)
        else:
            source, target_type = args[1], args[0].device.type
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if target_type is None or source.device.type == target_type:
            return None
        if target_type == "cpu":
            return "copies device memory to the host (waits for the device)"
        if not non_blocking:
            return "a blocking copy from host memory to the device"
        if not is_staging_memory(source):
            return ("a non_blocking copy from pageable host memory (synchronous on CUDA): "
                    "stage it through core.staging")
        return None

    # ---- reporting ----------------------------------------------------------

    def _report(self, reason: str, op: str) -> bool:
        """Record a violation; True: allowed by a frame of the stack."""
        frame = sys._getframe(1)
        site = None
        while frame is not None:
            name = f"{frame.f_globals.get('__name__')}:{frame.f_code.co_qualname}"
            if name in self.allow:
                self.allowed[name] += 1
                return True
            if site is None and "vllm_specextend" in frame.f_code.co_filename:
                path = frame.f_code.co_filename
                site = (f"{path[path.rindex('vllm_specextend'):]}:{frame.f_lineno} "
                        f"in {frame.f_code.co_qualname}")
            frame = frame.f_back
        violation = Violation(reason, op, site or "outside vllm_specextend")
        if violation not in self.violations:
            self.violations.append(violation)
        return False

    def summary(self) -> str:
        return "host syncs:\n" + "\n".join(f"  {v}" for v in self.violations)

    def assert_none(self) -> None:
        if self.violations:
            raise HostSyncError(self.summary())

    # ---- torch.tensor / torch.as_tensor -----------------------------------

    def __enter__(self):
        for name in ("tensor", "as_tensor"):
            original = getattr(torch, name)
            self._patched[name] = original
            setattr(torch, name, self._checked_factory(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch, name, original)
        self._patched.clear()
        return super().__exit__(*exc)

    def _checked_factory(self, name, original):
        def factory(data, *args, device=None, **kwargs):
            if _device_type(device) not in (None, "cpu"):
                self._report("copies host data to the device and waits", f"torch.{name}")
            return original(data, *args, device=device, **kwargs)

        return factory


def _stand_in_for_a_host_read(func, args, kwargs, error: Exception):
    if func is aten._to_copy.default:
        return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
    if func is aten.copy_.default:
        return args[0]
    if func is aten._local_scalar_dense.default:
        return torch.zeros((), dtype=args[0].dtype).item()
    raise error


def _device_type(device) -> str | None:
    return None if device is None else torch.device(device).type
