"""Per-request slots: each live request of the engine holds one index in
``0 .. capacity - 1`` for its per-request arrays, from its first step until it
leaves the batch.

Host-only bookkeeping, independent of vLLM. A batch that repeats the last
one's requests (most steps) is answered from a cache, so a step costs a list
comparison rather than a dictionary look-up per request.
"""

from __future__ import annotations

import numpy as np


class RequestSlots:
    """Which slot each live request holds; a freed slot is the next one taken."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slot_of: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._last_ids: list[str] | None = None
        self._last_slots = np.zeros(0, dtype=np.int64)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def items(self):
        """``(req_id, slot)`` of the live requests, in the order they arrived."""
        return self._slot_of.items()

    def assign(self, req_ids: list[str]) -> tuple[np.ndarray, list[int]]:
        """Each request's slot (``[rows]``), taking a free one for a request
        not seen before; and the rows of those new requests."""
        if req_ids == self._last_ids:
            return self._last_slots, []
        slot_of = self._slot_of
        new_rows = [row for row, req_id in enumerate(req_ids) if req_id not in slot_of]
        for row in new_rows:
            slot_of[req_ids[row]] = self._free.pop()
        slots = np.fromiter((slot_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        self._last_ids, self._last_slots = list(req_ids), slots
        return slots, new_rows

    def slots(self, req_ids: list[str]) -> np.ndarray:
        """The slots of requests already assigned."""
        if req_ids == self._last_ids:
            return self._last_slots
        return np.array([self._slot_of[r] for r in req_ids], dtype=np.int64)

    def departed(self, req_ids: list[str]) -> list[str]:
        """Live requests not in ``req_ids`` (they left the batch), in the
        order they arrived: freed slots are reused in the same order on
        every run and every rank."""
        if req_ids == self._last_ids:
            return []
        present = set(req_ids)
        return [req_id for req_id in self._slot_of if req_id not in present]

    def release(self, req_ids) -> list[int]:
        """Free the slots of requests that left (unknown ones are skipped);
        their slots, in the order given."""
        freed = []
        for req_id in req_ids:
            slot = self._slot_of.pop(req_id, None)
            if slot is not None:
                self._free.append(slot)
                freed.append(slot)
        if freed:
            self._last_ids = None
        return freed
