"""Per-request slots (``common/request_slots.py``): one per live request, a
freed one taken next, and arrivals and departures told to every feature
once (the adapter updates; a second update with the same batch changes
nothing)."""

import numpy as np
import pytest

from vllm_specextend.common.request_slots import RequestSlots


class Recorder:
    """A feature's view of the slots: what it was told."""

    def __init__(self, slots: RequestSlots) -> None:
        self.events: list[tuple[str, list[str], list[int]]] = []
        slots.subscribe(arrived=self.arrived, left=self.left)

    def arrived(self, req_ids, slots) -> None:
        self.events.append(("arrived", req_ids, slots.tolist()))

    def left(self, req_ids, slots) -> None:
        self.events.append(("left", req_ids, slots.tolist()))


def test_slots_are_kept_while_live_and_reused_once_freed():
    slots = RequestSlots(3)
    assert slots.update(["a", "b"]).tolist() == [0, 1]
    # The same batch again (answered from the cache), then reordered.
    assert slots.update(["a", "b"]).tolist() == [0, 1]
    assert slots.update(["b", "a"]).tolist() == [1, 0]
    slots.release(["a", "unknown"])
    # "a" left: the same batch as before must not be answered from the cache.
    assert slots.update(["b", "a"]).tolist() == [1, 0]
    assert slots.update(["b", "a", "c"]).tolist() == [1, 0, 2]
    assert dict(slots.items()) == {"b": 1, "a": 0, "c": 2} and len(slots) == 3
    # Requests missing from a batch left ("b", then "a"): the slot freed
    # last is taken first.
    assert slots.update(["c", "d", "e"]).tolist() == [2, 0, 1]


def test_every_feature_is_told_once_whichever_updates_first():
    slots = RequestSlots(4)
    control, retrieval = Recorder(slots), Recorder(slots)
    for batch in (["a", "b", "c"], ["b", "d"], ["b", "d"]):
        # Both features update with the step's batch: the second changes nothing.
        assert slots.update(batch).tolist() == slots.update(batch).tolist()
    expected = [("arrived", ["a", "b", "c"], [0, 1, 2]),
                ("left", ["a", "c"], [0, 2]),
                ("arrived", ["d"], [2])]
    assert control.events == retrieval.events == expected


def test_departures_come_in_arrival_order():
    # A set difference would order them by string hashes, which differ
    # between processes (and so would the slots reused after them).
    slots = RequestSlots(8)
    recorder = Recorder(slots)
    ids = [f"request-{i}" for i in range(8)]
    slots.update(ids)
    slots.update(ids[3:4])
    assert recorder.events[-1] == ("left", ids[:3] + ids[4:], [0, 1, 2, 4, 5, 6, 7])


def test_a_feature_takes_the_shared_slots_only_at_its_capacity():
    shared = RequestSlots(4)
    assert RequestSlots.shared_or_new(shared, 4) is shared
    assert RequestSlots.shared_or_new(None, 4) is not shared
    with pytest.raises(ValueError, match="request slots for 4 requests, 8 needed"):
        RequestSlots.shared_or_new(shared, 8)


class ReferenceSlots:
    """The slots' rules spelt out with a dictionary: departures in arrival
    order, then arrivals in row order, each taking the slot freed last."""

    def __init__(self, capacity: int) -> None:
        self.slot_of: dict[str, int] = {}
        self.free = list(range(capacity - 1, -1, -1))
        self.events: list[tuple[str, list[str], list[int]]] = []

    def update(self, req_ids: list[str]) -> list[int]:
        left = [req_id for req_id in self.slot_of if req_id not in set(req_ids)]
        if left:
            self.events.append(("left", left, [self.slot_of[r] for r in left]))
            self.free += [self.slot_of.pop(r) for r in left]
        new = [req_id for req_id in req_ids if req_id not in self.slot_of]
        for req_id in new:
            self.slot_of[req_id] = self.free.pop()
        if new:
            self.events.append(("arrived", new, [self.slot_of[r] for r in new]))
        return [self.slot_of[r] for r in req_ids]

    def release(self, req_ids: list[str]) -> None:
        left = [req_id for req_id in req_ids if req_id in self.slot_of]
        if left:
            self.events.append(("left", left, [self.slot_of[r] for r in left]))
            self.free += [self.slot_of.pop(r) for r in left]


def test_random_batches_get_the_reference_slots():
    # Rows are compared with the last batch's to find the changed ones:
    # reorders, shorter and longer batches, and requests coming back.
    rng = np.random.default_rng(0)
    slots, reference = RequestSlots(16), ReferenceSlots(16)
    recorder = Recorder(slots)
    batch: list[str] = []
    for step in range(400):
        batch = [r for r in batch if rng.random() > 0.15]
        while len(batch) < 16 and rng.random() < 0.6:
            batch.append(f"r{rng.integers(0, 40)}" if rng.random() < 0.2 else f"n{step}-{len(batch)}")
        batch = list(dict.fromkeys(batch))
        if rng.random() < 0.3:
            rng.shuffle(batch)
        if rng.random() < 0.1 and batch:
            # Finished before the batch shows it; it may come back.
            slots.release([batch[-1]])
            reference.release([batch[-1]])
        assert slots.update(batch).tolist() == reference.update(batch)
    assert recorder.events == reference.events
