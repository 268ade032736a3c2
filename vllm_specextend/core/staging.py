"""Host-built index lists as device tensors, without a host sync."""

from __future__ import annotations

import torch


class IndexStager:
    """Host lists of batch rows or request slots as device index tensors:
    numpy writes into pinned staging rows, then ``non_blocking`` copies into
    device buffers.

    ``depth`` sets of rows rotate between steps, so a step never overwrites
    rows whose copies an earlier step still in flight may read: like vLLM's
    ``UvaBufferPool``, depth must be at least the number of steps in flight
    (``VllmConfig.max_concurrent_batches``, at least 2).
    """

    MAX_INDEX_LISTS_PER_STEP = 16

    def __init__(self, max_len: int, device: torch.device, depth: int = 2) -> None:
        if depth < 2:
            raise ValueError(f"IndexStager depth must be >= 2, got {depth}")
        shape = (depth, self.MAX_INDEX_LISTS_PER_STEP, max_len)
        on_host = device.type == "cpu"
        self.depth = depth
        self._host = torch.zeros(
            shape, dtype=torch.int64, pin_memory=not on_host and torch.cuda.is_available()
        )
        self._host_np = self._host.numpy()
        self._device = (
            self._host if on_host else torch.zeros(shape, dtype=torch.int64, device=device)
        )
        self._set = 0
        self._used = 0

    def next_step(self) -> IndexStager:
        self._set = (self._set + 1) % self.depth
        self._used = 0
        return self

    def __call__(self, values: list[int]) -> torch.Tensor:
        if self._used == self.MAX_INDEX_LISTS_PER_STEP:
            raise RuntimeError(
                f"more than {self.MAX_INDEX_LISTS_PER_STEP} index lists staged in one step"
            )
        index = self._used
        self._used += 1
        count = len(values)
        self._host_np[self._set, index, :count] = values
        staged = self._device[self._set, index, :count]
        if self._device is not self._host:
            staged.copy_(self._host[self._set, index, :count], non_blocking=True)
        return staged
