"""Per-request slots: each live request of the engine holds one index in
``0 .. capacity - 1`` for its per-request arrays, from the first step it is
in until it leaves the batch.

One instance per drafter, shared by its features (retrieval's planner and
goodput control): whichever sees a step's batch first updates it, and every
feature is told which requests arrived and which left, whether or not it
runs that step. Host-only bookkeeping, independent of vLLM. A batch that
repeats the last one's requests (most steps) is answered from a cache, so a
step costs a list comparison rather than a dictionary look-up per request.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat

import numpy as np

SlotHandler = Callable[[list[str], np.ndarray], None]
"""Called with request ids and their slots (``[n]``, int64)."""


class RequestSlots:
    """Which slot each live request holds; a freed slot is the next one taken."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slot_of: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._last_ids: list[str] | None = None
        self._last_slots = np.zeros(0, dtype=np.int64)
        self._on_arrival: list[SlotHandler] = []
        self._on_departure: list[SlotHandler] = []

    @classmethod
    def shared_or_new(cls, shared: RequestSlots | None, capacity: int) -> RequestSlots:
        """``shared`` (a drafter's, checked to hold ``capacity`` requests),
        or new slots of one's own."""
        if shared is None:
            return cls(capacity)
        if shared.capacity != capacity:
            raise ValueError(f"request slots for {shared.capacity} requests, "
                             f"{capacity} needed")
        return shared

    def subscribe(self, *, arrived: SlotHandler | None = None,
                  left: SlotHandler | None = None) -> None:
        """Have ``arrived`` called with the requests that took slots (before
        the update that assigned them returns) and ``left`` with those that
        left (before their slots are freed), in the order of subscription."""
        if arrived is not None:
            self._on_arrival.append(arrived)
        if left is not None:
            self._on_departure.append(left)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def items(self):
        """``(req_id, slot)`` of the live requests, in the order they arrived."""
        return self._slot_of.items()

    def update(self, req_ids: list[str]) -> np.ndarray:
        """This step's batch: the live requests not in it leave, those new in
        it take free slots (subscribers are told of both); each row's slot
        (``[rows]``). Calling it again with the same batch changes nothing."""
        if req_ids == self._last_ids:
            return self._last_slots
        slot_of = self._slot_of
        slots = np.fromiter(map(slot_of.get, req_ids, repeat(-1)), dtype=np.int64,
                            count=len(req_ids))
        new_rows = np.flatnonzero(slots < 0)
        if len(slot_of) > len(req_ids) - len(new_rows):
            # Some live requests are not in the batch. In arrival order:
            # freed slots are reused in the same order on every run and rank.
            present = set(req_ids)
            self.release([req_id for req_id in slot_of if req_id not in present])
        self._last_ids, self._last_slots = list(req_ids), slots
        if len(new_rows):
            taken = [self._free.pop() for _ in range(len(new_rows))]
            slots[new_rows] = taken
            new_ids = [req_ids[row] for row in new_rows.tolist()]
            slot_of.update(zip(new_ids, taken))
            self._notify(self._on_arrival, new_ids, slots[new_rows])
        return slots

    def slots(self, req_ids: list[str]) -> np.ndarray:
        """The slots of live requests."""
        if req_ids == self._last_ids:
            return self._last_slots
        return np.array([self._slot_of[r] for r in req_ids], dtype=np.int64)

    def release(self, req_ids: list[str]) -> None:
        """Requests that left (unknown ones are skipped): subscribers are
        told, then their slots are freed, in the order given."""
        left = [req_id for req_id in req_ids if req_id in self._slot_of]
        if not left:
            return
        slots = np.array([self._slot_of.pop(req_id) for req_id in left], dtype=np.int64)
        self._notify(self._on_departure, left, slots)
        self._free += slots.tolist()
        self._last_ids = None

    @staticmethod
    def _notify(handlers: list[SlotHandler], req_ids: list[str], slots: np.ndarray) -> None:
        for handler in handlers:
            handler(req_ids, slots)
