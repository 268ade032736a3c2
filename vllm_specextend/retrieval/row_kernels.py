"""The planner's per-row host work, compiled with numba (as goodput control's
loops, ``control/choice_kernel.py``, and vLLM's n-gram proposer): a step's
classification and bookkeeping are a few integer tests per row, which as
numpy would be some thirty array operations, each paying numpy's per-call
overhead. Integers only, so the results are exactly the numpy expressions'
in the docstrings. Compiled (or loaded from the cache) at the planner's
construction (:func:`warm_up_row_kernels`); arguments are int64 / bool arrays
(``common/kernel_args.py``), so no signature is compiled mid-serving.
"""

from __future__ import annotations

import numpy as np

from vllm_specextend.common.compiled import compiled
from vllm_specextend.retrieval.refresh import REFRESH_CAUSES

NO_REFRESH = -1
"""A retrieval row whose selection stays (``REFRESH_CAUSES`` index otherwise)."""
FIRST, INTERVAL = REFRESH_CAUSES.index("first"), REFRESH_CAUSES.index("interval")


@compiled
def classify_rows(query_lens, context_lens, prompt_lens, max_num_speculative_tokens,
                  min_context_tokens, draft_window, compact_positions):
    """Per row: ``seq_lens = context + query``; ``is_decode`` (the prompt in
    the cache, a query of at most K + 1: :func:`~vllm_specextend.retrieval.request_rows.decode_rows`);
    ``beyond_window`` (``seq_lens + K > draft_window``); and the rows that
    retrieve: decode rows of at least ``min_context_tokens`` or, with compact
    positions, beyond the window. Also the number of rows that are not
    decodes (prompt chunks)."""
    rows = query_lens.shape[0]
    k = max_num_speculative_tokens
    seq_lens = np.empty(rows, np.int64)
    is_decode = np.empty(rows, np.bool_)
    beyond_window = np.empty(rows, np.bool_)
    retrieval_rows = np.empty(rows, np.int64)
    retrieving = prompt_chunks = 0
    for row in range(rows):
        seq_len = context_lens[row] + query_lens[row]
        decode = context_lens[row] >= prompt_lens[row] and query_lens[row] <= k + 1
        beyond = seq_len + k > draft_window
        seq_lens[row], is_decode[row], beyond_window[row] = seq_len, decode, beyond
        prompt_chunks += not decode
        if decode and (seq_len >= min_context_tokens or (compact_positions and beyond)):
            retrieval_rows[retrieving] = row
            retrieving += 1
    return seq_lens, is_decode, beyond_window, retrieval_rows[:retrieving], prompt_chunks


@compiled
def reset_slots(slots, tracked, decoded, steps_since_retrieval, has_selection, area_of_slot,
                refresh_counts):
    """Start tracking the requests in ``slots``: fresh state, no area yet."""
    for slot in slots:
        tracked[slot], decoded[slot], has_selection[slot] = True, False, False
        steps_since_retrieval[slot], area_of_slot[slot] = 0, -1
        refresh_counts[slot, :] = 0


@compiled
def advance_retrieval_rows(slots, tracked, decoded, steps_since_retrieval, has_selection,
                           area_of_slot, refresh_counts, retrieval_interval):
    """A step of the retrieval rows' requests (``slots``): untracked ones
    start (:func:`reset_slots`; returned, for their areas), every one counts
    the step, and each row's cause to retrieve: ``first`` without a
    selection, ``interval`` once ``retrieval_interval`` steps have passed,
    else ``NO_REFRESH``. Returns ``(causes, new slots)``."""
    rows = slots.shape[0]
    causes = np.empty(rows, np.int64)
    new = np.empty(rows, np.int64)
    num_new = 0
    for row in range(rows):
        if not tracked[slots[row]]:
            new[num_new] = slots[row]
            num_new += 1
    reset_slots(new[:num_new], tracked, decoded, steps_since_retrieval, has_selection,
                area_of_slot, refresh_counts)
    for row in range(rows):
        slot = slots[row]
        decoded[slot] = True
        steps_since_retrieval[slot] += 1
        if not has_selection[slot]:
            causes[row] = FIRST
        elif steps_since_retrieval[slot] >= retrieval_interval:
            causes[row] = INTERVAL
        else:
            causes[row] = NO_REFRESH
    return causes, new[:num_new]


@compiled
def note_retrievals(due_slots, due_causes, has_selection, steps_since_retrieval,
                    refresh_counts, counts_by_cause):
    """The due rows retrieved: each has a new selection, its step count
    restarts, and its retrievals (and the step's, ``counts_by_cause``) count
    the cause."""
    for row in range(due_slots.shape[0]):
        slot, cause = due_slots[row], due_causes[row]
        has_selection[slot] = True
        steps_since_retrieval[slot] = 0
        refresh_counts[slot, cause] += 1
        counts_by_cause[cause] += 1


@compiled
def classify_step(query_lens, context_lens, prompt_lens, slots, max_num_speculative_tokens,
                  min_context_tokens, draft_window, compact_positions, state,
                  retrieval_interval, note, counts_by_cause):
    """A step's rows in one call: :func:`classify_rows`, then
    :func:`advance_retrieval_rows` over the retrieval rows' slots (of
    ``slots``, the rows'), the rows due and, with ``note``, their
    :func:`note_retrievals`. ``state``: the planner's per-slot ``(tracked,
    decoded, steps since retrieval, has selection, area, retrievals by
    cause)``. Returns ``(seq_lens, is_decode, beyond_window, prompt chunks,
    retrieval rows, their slots, their causes, due rows, due slots, due
    causes, new slots)``."""
    tracked, decoded, steps_since_retrieval, has_selection, area_of_slot, refresh_counts = state
    seq_lens, is_decode, beyond_window, rows, prompt_chunks = classify_rows(
        query_lens, context_lens, prompt_lens, max_num_speculative_tokens, min_context_tokens,
        draft_window, compact_positions)
    retrieving = rows.shape[0]
    retrieval_slots = np.empty(retrieving, np.int64)
    for index in range(retrieving):
        retrieval_slots[index] = slots[rows[index]]
    causes, new = advance_retrieval_rows(retrieval_slots, tracked, decoded,
                                         steps_since_retrieval, has_selection, area_of_slot,
                                         refresh_counts, retrieval_interval)
    due = 0
    for index in range(retrieving):
        due += causes[index] != NO_REFRESH
    due_rows, due_slots, due_causes = (np.empty(due, np.int64), np.empty(due, np.int64),
                                       np.empty(due, np.int64))
    due = 0
    for index in range(retrieving):
        if causes[index] != NO_REFRESH:
            due_rows[due], due_slots[due] = rows[index], retrieval_slots[index]
            due_causes[due] = causes[index]
            due += 1
    if note:
        note_retrievals(due_slots, due_causes, has_selection, steps_since_retrieval,
                        refresh_counts, counts_by_cause)
    return (seq_lens, is_decode, beyond_window, prompt_chunks, rows, retrieval_slots, causes,
            due_rows, due_slots, due_causes, new)


def warm_up_row_kernels() -> None:
    """Compile (or load) the kernels the planner calls, for the argument
    types it passes (those called only from compiled code come with their
    callers)."""
    ints, flags = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=bool)
    counts = np.zeros((1, 3), dtype=np.int64)
    classify_rows(ints, ints, ints, 1, 1, 1, False)
    reset_slots(ints, flags.copy(), flags.copy(), ints.copy(), flags.copy(), ints.copy(), counts)
    note_retrievals(ints, ints, flags.copy(), ints.copy(), counts, np.zeros(3, dtype=np.int64))
    classify_step(ints, ints, ints, ints, 1, 1, 1, False, (
        flags.copy(), flags.copy(), ints.copy(), flags.copy(), ints.copy(), counts), 1, True,
        np.zeros(3, dtype=np.int64))
