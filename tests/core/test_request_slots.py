"""Per-request slots (``core/request_slots.py``): one per live request, a
freed one taken next, and departures as the batch shows them."""

from vllm_specextend.core.request_slots import RequestSlots


def test_slots_are_kept_while_live_and_reused_once_freed():
    slots = RequestSlots(3)
    first, new_rows = slots.assign(["a", "b"])
    assert first.tolist() == [0, 1] and new_rows == [0, 1]
    # The same batch again (answered from the cache), then reordered.
    assert slots.assign(["a", "b"])[0].tolist() == [0, 1]
    assert slots.assign(["b", "a"])[0].tolist() == [1, 0]
    assert slots.departed(["b"]) == ["a"] and slots.departed(["b", "a"]) == []
    assert slots.release(["a", "unknown"]) == [0]
    # "a" left: the same batch as before must not be answered from the cache.
    again, new_rows = slots.assign(["b", "a"])
    assert again.tolist() == [1, 0] and new_rows == [1]
    assert slots.assign(["b", "a", "c"])[0].tolist() == [1, 0, 2]
    assert dict(slots.items()) == {"b": 1, "a": 0, "c": 2} and len(slots) == 3


def test_departures_come_in_arrival_order():
    # A set difference would order them by string hashes, which differ
    # between processes (and so would the slots reused after them).
    slots = RequestSlots(8)
    ids = [f"request-{i}" for i in range(8)]
    slots.assign(ids)
    assert slots.departed(ids[3:4]) == ids[:3] + ids[4:]
