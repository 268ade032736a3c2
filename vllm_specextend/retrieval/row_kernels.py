"""The planner's per-row host work, compiled with numba (as goodput control's
loops, ``control/choice_kernel.py``, and vLLM's n-gram proposer): a step's
classification and bookkeeping are a few integer tests per row, which as
numpy would be some thirty array operations, each paying numpy's per-call
overhead. Integers only, so the results are exactly the numpy expressions'
in the docstrings. Compiled (or loaded from the cache) at the planner's
construction (:func:`warm_up_row_kernels`). The loops take named records
(numba reads a named tuple's fields by name): a step's lengths
(:class:`RowLengths`), the planner's rules (:class:`RowRules`) and its
per-slot state (:class:`RetrievalRowState`), each built by its own
constructor with one dtype per field, so no signature is compiled
mid-serving and a new per-request field is one line in a record.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vllm_specextend.common.compiled import compiled
from vllm_specextend.common.kernel_args import ints
from vllm_specextend.retrieval.refresh import REFRESH_CAUSES

NO_REFRESH = -1
"""A retrieval row whose selection stays (``REFRESH_CAUSES`` index otherwise)."""
FIRST, INTERVAL = REFRESH_CAUSES.index("first"), REFRESH_CAUSES.index("interval")


class RowLengths(NamedTuple):
    """A step's rows: int64 lengths."""

    query_lens: np.ndarray
    context_lens: np.ndarray
    prompt_lens: np.ndarray

    @classmethod
    def of(cls, query_lens, context_lens, prompt_lens) -> RowLengths:
        return cls(ints(query_lens), ints(context_lens), ints(prompt_lens))


class RowRules(NamedTuple):
    """What the planner's configuration says about a row."""

    max_num_speculative_tokens: int
    min_context_tokens: int
    """Decode rows this long or longer retrieve."""
    draft_window: int
    compact_positions: bool
    """Rows beyond the draft's window retrieve too."""
    retrieval_interval: int
    """Steps after which a selection is refreshed."""

    @classmethod
    def of(cls, max_num_speculative_tokens: int, min_context_tokens: int, draft_window: int,
           compact_positions: bool, retrieval_interval: int) -> RowRules:
        return cls(int(max_num_speculative_tokens), int(min_context_tokens), int(draft_window),
                   bool(compact_positions), int(retrieval_interval))


class RetrievalRowState(NamedTuple):
    """The planner's state of each request, by request slot (updated in
    place by the loops)."""

    tracked: np.ndarray
    """bool: tracked (from its first retrieval row or windowed prompt chunk)."""
    decoded: np.ndarray
    """bool: tracked since a decode step (else only through windowed prefill)."""
    steps_since_retrieval: np.ndarray
    """int64."""
    has_selection: np.ndarray
    """bool."""
    area_of_slot: np.ndarray
    """int64: its private layout area (-1: laid out in place)."""
    refresh_counts: np.ndarray
    """int64 ``[slots, causes]``: retrievals by cause."""

    @classmethod
    def new(cls, capacity: int) -> RetrievalRowState:
        flags = lambda: np.zeros(capacity, dtype=bool)  # noqa: E731
        return cls(tracked=flags(), decoded=flags(),
                   steps_since_retrieval=np.zeros(capacity, dtype=np.int64),
                   has_selection=flags(), area_of_slot=np.full(capacity, -1, dtype=np.int64),
                   refresh_counts=np.zeros((capacity, len(REFRESH_CAUSES)), dtype=np.int64))


@compiled
def classify_rows(lengths, rules):
    """Per row: ``seq_lens = context + query``; ``is_decode`` (the prompt in
    the cache, a query of at most K + 1:
    :func:`~vllm_specextend.retrieval.request_rows.decode_rows`);
    ``beyond_window`` (``seq_lens + K > draft_window``); and the rows that
    retrieve: decode rows of at least ``min_context_tokens`` or, with compact
    positions, beyond the window. Also the number of rows that are not
    decodes (prompt chunks)."""
    query_lens, context_lens = lengths.query_lens, lengths.context_lens
    rows = query_lens.shape[0]
    k = rules.max_num_speculative_tokens
    seq_lens = np.empty(rows, np.int64)
    is_decode = np.empty(rows, np.bool_)
    beyond_window = np.empty(rows, np.bool_)
    retrieval_rows = np.empty(rows, np.int64)
    retrieving = prompt_chunks = 0
    for row in range(rows):
        seq_len = context_lens[row] + query_lens[row]
        decode = context_lens[row] >= lengths.prompt_lens[row] and query_lens[row] <= k + 1
        beyond = seq_len + k > rules.draft_window
        seq_lens[row], is_decode[row], beyond_window[row] = seq_len, decode, beyond
        prompt_chunks += not decode
        if decode and (seq_len >= rules.min_context_tokens
                       or (rules.compact_positions and beyond)):
            retrieval_rows[retrieving] = row
            retrieving += 1
    return seq_lens, is_decode, beyond_window, retrieval_rows[:retrieving], prompt_chunks


@compiled
def reset_slots(slots, state):
    """Start tracking the requests in ``slots``: fresh state, no area yet."""
    for slot in slots:
        state.tracked[slot], state.decoded[slot], state.has_selection[slot] = True, False, False
        state.steps_since_retrieval[slot], state.area_of_slot[slot] = 0, -1
        state.refresh_counts[slot, :] = 0


@compiled
def advance_retrieval_rows(slots, state, retrieval_interval):
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
        if not state.tracked[slots[row]]:
            new[num_new] = slots[row]
            num_new += 1
    reset_slots(new[:num_new], state)
    for row in range(rows):
        slot = slots[row]
        state.decoded[slot] = True
        state.steps_since_retrieval[slot] += 1
        if not state.has_selection[slot]:
            causes[row] = FIRST
        elif state.steps_since_retrieval[slot] >= retrieval_interval:
            causes[row] = INTERVAL
        else:
            causes[row] = NO_REFRESH
    return causes, new[:num_new]


@compiled
def note_retrievals(due_slots, due_causes, state, counts_by_cause):
    """The due rows retrieved: each has a new selection, its step count
    restarts, and its retrievals (and the step's, ``counts_by_cause``) count
    the cause."""
    for row in range(due_slots.shape[0]):
        slot, cause = due_slots[row], due_causes[row]
        state.has_selection[slot] = True
        state.steps_since_retrieval[slot] = 0
        state.refresh_counts[slot, cause] += 1
        counts_by_cause[cause] += 1


@compiled
def classify_step(lengths, slots, rules, state, note, counts_by_cause):
    """A step's rows in one call: :func:`classify_rows`, then
    :func:`advance_retrieval_rows` over the retrieval rows' slots (of
    ``slots``, the rows'), the rows due and, with ``note``, their
    :func:`note_retrievals`. Returns ``(seq_lens, is_decode,
    beyond_window, prompt chunks, retrieval rows, their slots, their causes,
    due rows, due slots, due causes, new slots)``."""
    seq_lens, is_decode, beyond_window, rows, prompt_chunks = classify_rows(lengths, rules)
    retrieving = rows.shape[0]
    retrieval_slots = np.empty(retrieving, np.int64)
    for index in range(retrieving):
        retrieval_slots[index] = slots[rows[index]]
    causes, new = advance_retrieval_rows(retrieval_slots, state, rules.retrieval_interval)
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
        note_retrievals(due_slots, due_causes, state, counts_by_cause)
    return (seq_lens, is_decode, beyond_window, prompt_chunks, rows, retrieval_slots, causes,
            due_rows, due_slots, due_causes, new)


def warm_up_row_kernels() -> None:
    """Compile (or load) the kernels the planner calls, on records built by
    the constructors the planner uses (those called only from compiled code
    come with their callers; ``tests/retrieval/test_planner.py`` checks that
    planning steps compile nothing after it)."""
    lengths = RowLengths.of([1], [0], [1])
    rules = RowRules.of(1, 1, 1, False, 1)
    state = RetrievalRowState.new(1)
    slots = ints([0])
    counts = np.zeros(len(REFRESH_CAUSES), dtype=np.int64)
    classify_rows(lengths, rules)
    reset_slots(slots, state)
    note_retrievals(slots, slots, state, counts)
    classify_step(lengths, slots, rules, state, True, counts)
