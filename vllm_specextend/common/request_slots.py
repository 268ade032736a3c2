"""Per-request slots: each live request of the engine holds one index in
``0 .. capacity - 1`` for its per-request arrays, from the first step it is
in until it leaves the batch.

One instance per drafter, shared by its features (retrieval's planner and
goodput control): the drafter adapter that owns it updates it with every
step's batch, before either feature runs, and every feature is told which
requests arrived and which left, whether or not it runs that step; the
features only look their slots up (:meth:`RequestSlots.of_step`). A feature
built without shared slots owns its own and updates them itself. Host-only
bookkeeping, independent of vLLM. A batch that repeats the last one's requests
(most steps) is answered from a cache, so a step costs a list comparison
rather than a dictionary look-up per request; another looks up only the rows
whose request changed, and finds departures and free slots in one compiled
pass over the slots (:func:`settle_slots`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm_specextend.common.compiled import compiled

SlotHandler = Callable[[list[str], np.ndarray], None]
"""Called with request ids and their slots (``[n]``, int64)."""


class RequestSlots:
    """Which slot each live request holds; a freed slot is the next one taken."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slot_of: dict[str, int] = {}
        # Per slot: who holds it and since when (departures are told in
        # arrival order); free slots as a stack, the last freed on top.
        self._id_of: list[str | None] = [None] * capacity
        self._live = np.zeros(capacity, dtype=bool)
        self._arrival = np.zeros(capacity, dtype=np.int64)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._counts = np.array([capacity, 0], dtype=np.int64)
        """Free slots, arrivals so far."""
        self._last_ids: list[str] | None = None
        self._last_rows = np.zeros(0, dtype=object)
        """The last batch's ids as an array (rows compared to find changes)."""
        self._last_slots = np.zeros(0, dtype=np.int64)
        self._on_arrival: list[SlotHandler] = []
        self._on_departure: list[SlotHandler] = []
        settle_slots(np.zeros(0, dtype=np.int64), self._live, self._arrival, self._free,
                     self._counts)  # compiled (or loaded) now

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
        rows = np.array(req_ids, dtype=object)
        last = len(self._last_rows)
        if last == len(rows):  # most steps: rows replaced or moved
            slots = self._last_slots.copy()
            changed = (rows != self._last_rows).nonzero()[0]
        else:
            kept = min(last, len(rows))
            slots = np.zeros(len(rows), dtype=np.int64)
            slots[:kept] = self._last_slots[:kept]
            changed = np.concatenate(((rows[:kept] != self._last_rows[:kept]).nonzero()[0],
                                      np.arange(kept, len(rows))))
        get = self._slot_of.get
        slots[changed] = [get(req_id, -1) for req_id in rows[changed].tolist()]
        gone, new_rows = settle_slots(slots, self._live, self._arrival, self._free,
                                      self._counts)
        if gone.size:
            # In arrival order: freed slots are reused in the same order on
            # every run and rank.
            self._left([self._id_of[slot] for slot in gone.tolist()], gone)
        self._last_ids, self._last_rows, self._last_slots = list(req_ids), rows, slots
        if new_rows.size:
            new_ids = rows[new_rows].tolist()
            new_slots = slots[new_rows]
            taken = new_slots.tolist()
            self._slot_of.update(zip(new_ids, taken))
            for req_id, slot in zip(new_ids, taken):
                self._id_of[slot] = req_id
            self._notify(self._on_arrival, new_ids, new_slots)
        return slots

    def of_step(self, req_ids: list[str], owned: bool) -> np.ndarray:
        """The step's slots, for a feature: :meth:`update` when it owns these
        slots, else those its owner's update gave this batch."""
        return self.update(req_ids) if owned else self.slots(req_ids)

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
        slots = np.array([self._slot_of[req_id] for req_id in left], dtype=np.int64)
        self._left(left, slots)
        free, _ = self._counts
        self._free[free:free + len(slots)] = slots
        self._live[slots] = False
        self._counts[0] += len(slots)
        self._last_ids, self._last_rows = None, self._last_rows[:0]

    def _left(self, req_ids: list[str], slots: np.ndarray) -> None:
        """Subscribers are told; the ids are dropped (the slots' arrays are
        the caller's)."""
        self._notify(self._on_departure, req_ids, slots)
        for req_id in req_ids:
            del self._slot_of[req_id]
        for slot in slots.tolist():
            self._id_of[slot] = None

    @staticmethod
    def _notify(handlers: list[SlotHandler], req_ids: list[str], slots: np.ndarray) -> None:
        for handler in handlers:
            handler(req_ids, slots)


@compiled
def settle_slots(slots, live, arrival, free, counts):
    """A batch's slots (``slots``: -1 for requests without one): live slots
    no row holds are freed, in arrival order (returned), then each new row
    takes the slot on top of the ``free`` stack (written into ``slots``;
    their rows returned). ``counts``: ``[free slots, arrivals so far]``."""
    capacity = live.shape[0]
    held = np.zeros(capacity, np.bool_)
    num_new = 0
    for row in range(slots.shape[0]):
        if slots[row] >= 0:
            held[slots[row]] = True
        else:
            num_new += 1
    num_gone = 0
    gone = np.empty(capacity, np.int64)
    for slot in range(capacity):
        if live[slot] and not held[slot]:
            # Insertion by arrival (few leave a step).
            at = num_gone
            while at > 0 and arrival[gone[at - 1]] > arrival[slot]:
                gone[at] = gone[at - 1]
                at -= 1
            gone[at] = slot
            num_gone += 1
    top = counts[0]
    for i in range(num_gone):
        live[gone[i]] = False
        free[top] = gone[i]
        top += 1
    new_rows = np.empty(num_new, np.int64)
    num_new = 0
    for row in range(slots.shape[0]):
        if slots[row] < 0:
            top -= 1
            slot = free[top]
            slots[row] = slot
            live[slot] = True
            arrival[slot] = counts[1]
            counts[1] += 1
            new_rows[num_new] = row
            num_new += 1
    counts[0] = top
    return gone[:num_gone], new_rows
