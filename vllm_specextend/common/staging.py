"""Host-built index lists as device tensors, without a host sync.

A ``non_blocking`` copy to the device is asynchronous only from page-locked
(pinned) host memory; from pageable memory (a numpy array, a fresh CPU
tensor) CUDA copies synchronously. Per-step host data therefore goes through
buffers allocated once by :func:`host_staging_buffer`.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

_STAGING_STORAGES: set[int] = set()
"""Storage addresses of live staging buffers (see :func:`is_staging_memory`)."""


def pin_memory_available() -> bool:
    """Pinned host memory needs an accelerator's allocator (CPU builds have
    none); as vLLM's ``is_pin_memory_available`` on CUDA."""
    return torch.cuda.is_available()


def host_staging_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host buffer that ``non_blocking`` copies to the device read
    asynchronously: pinned where pinning exists. Registered, so a check on a
    CPU-only build, where nothing can be pinned, tells it from pageable
    memory (``tests/host_sync_check.py``)."""
    buffer = torch.zeros(shape, dtype=dtype, pin_memory=pin_memory_available())
    address = buffer.untyped_storage().data_ptr()
    _STAGING_STORAGES.add(address)
    weakref.finalize(buffer, _STAGING_STORAGES.discard, address)
    return buffer


def is_staging_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a view too) lies in pinned memory or a staging buffer."""
    return tensor.is_pinned() or tensor.untyped_storage().data_ptr() in _STAGING_STORAGES


class IndexStager:
    """Host lists of batch rows or request slots as device index tensors:
    numpy writes into pinned staging rows, then ``non_blocking`` copies into
    device buffers.

    ``depth`` sets of rows rotate between steps, so a step never overwrites
    rows whose copies an earlier step still in flight may read: like vLLM's
    ``UvaBufferPool``, depth must be at least the number of steps in flight
    (``VllmConfig.max_concurrent_batches``, at least 2).

    Invariant: every staged list starts at a multiple of :data:`ALIGNMENT`
    bytes. Triton specialises a pointer argument on 16-byte alignment, so a
    list handed to a kernel (the planner's rows and slots) at an 8-byte
    offset would compile a new variant of a kernel warmed up with aligned
    tensors, mid-serving. Lists lie back to back, each padded to the
    alignment (``tests/common/test_staging.py`` checks every planner launch).
    """

    MAX_INDEX_LISTS_PER_STEP = 16
    ALIGNMENT = 16
    """Bytes each staged list's start is a multiple of."""

    def __init__(self, max_len: int, device: torch.device, depth: int = 2,
                 lists_per_step: int = MAX_INDEX_LISTS_PER_STEP) -> None:
        """
        Args:
            max_len: longest list staged.
            lists_per_step: lists staged between two ``next_step`` calls.
        """
        if depth < 2:
            raise ValueError(f"IndexStager depth must be >= 2, got {depth}")
        # Per set, the step's lists back to back, each padded to the
        # alignment: one copy and one split stage several.
        self._align = self.ALIGNMENT // torch.int64.itemsize
        shape = (depth, lists_per_step * self._padded(max_len))
        on_host = device.type == "cpu"
        self.depth = depth
        self.lists_per_step = lists_per_step
        self._host = (torch.zeros(shape, dtype=torch.int64) if on_host
                      else host_staging_buffer(shape, torch.int64))
        self._host_np = self._host.numpy()
        self._device = (
            self._host if on_host else torch.zeros(shape, dtype=torch.int64, device=device)
        )
        # Each set's row, viewed once: a step slices it, nothing more.
        self._host_sets = self._host.unbind(0)
        self._device_sets = self._device.unbind(0)
        self._set = 0
        self._lists = 0
        self._end = 0

    def next_step(self) -> IndexStager:
        self._set = (self._set + 1) % self.depth
        self._lists = self._end = 0
        return self

    def __call__(self, values: list[int] | np.ndarray) -> torch.Tensor:
        """``values`` as an int64 device tensor (valid until this set of
        rows comes round again, ``depth`` steps on)."""
        return self.stage(values)[0]

    def stage(self, *lists: list[int] | np.ndarray) -> tuple[torch.Tensor, ...]:
        """Several lists with one copy (they lie back to back) and one split."""
        if self._lists + len(lists) > self.lists_per_step:
            raise RuntimeError(
                f"more than {self.lists_per_step} index lists staged in one step"
            )
        self._lists += len(lists)
        start = end = self._end
        row = self._host_np[self._set]
        # Pieces of the split: what lies before, then per list its values
        # and its padding, then the rest.
        sizes = [start]
        for values in lists:
            length = len(values)
            row[end:end + length] = values
            padded = self._padded(length)
            sizes += [length, padded - length]
            end += padded
        self._end = end
        device_set = self._device_sets[self._set]
        if self._device is not self._host:
            device_set[start:end].copy_(self._host_sets[self._set][start:end], non_blocking=True)
        sizes.append(len(device_set) - end)
        return device_set.split_with_sizes(sizes)[1:-1:2]

    def _padded(self, length: int) -> int:
        """``length`` elements rounded up to whole alignments."""
        return -(-length // self._align) * self._align
