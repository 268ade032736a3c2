"""The planner's per-request state and its classification of a step's rows.

Each tracked request holds a slot in per-slot host arrays (decoded yet, steps
since its last retrieval, selection made, private area, retrievals by cause);
:meth:`RequestRows._classify_rows` is numpy over those arrays (no device
reads): which rows retrieve, which are due, which prefill windowed.
:class:`RequestRows` is a base of :class:`~vllm_specextend.core.planner.RetrievalPlanner`,
which sets the attributes annotated below.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specextend.core.counters import RetrievalStats
from vllm_specextend.core.draft_view import PlanningBatch, PrivateLayouts
from vllm_specextend.core.options import SpecExtendConfig
from vllm_specextend.core.refresh import REFRESH_CAUSES, AcceptanceTrend


def decode_rows(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    prompt_lens: np.ndarray,
    max_num_speculative_tokens: int,
) -> np.ndarray:
    """Rows that verify drafts (or decode) rather than prefill.

    A row decodes when its prompt is already in the KV cache and its query
    holds at most one token plus ``max_num_speculative_tokens`` drafts. The
    prompt test keeps a last prefill chunk of K + 1 tokens or fewer a prefill;
    the bound on the configured K keeps steps with a reduced or dynamic K
    decodes; longer queries after the prompt (a preempted request recomputing
    its output) stay prefills.
    """
    return (np.asarray(context_lens) >= np.asarray(prompt_lens)) & (
        np.asarray(query_lens) <= max_num_speculative_tokens + 1
    )


_NO_REFRESH = -1
_FIRST, _INTERVAL, _ACCEPTANCE = (REFRESH_CAUSES.index(c)
                                  for c in ("first", "interval", "acceptance"))


@dataclass
class _RequestState:
    slot: int
    refresh_counts: np.ndarray
    """``[len(REFRESH_CAUSES)]``: its row of the planner's per-slot counts."""
    area: int = -1
    """Its private layout area (-1: laid out in place)."""
    acceptance: AcceptanceTrend = field(default_factory=AcceptanceTrend)
    """Observed only with ``retrieval_refresh: acceptance``."""

    @property
    def refreshes(self) -> dict[str, int]:
        """Retrievals by cause."""
        return dict(zip(REFRESH_CAUSES, self.refresh_counts.tolist()))


def _rows() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class StepRows:
    """This step's rows (numpy arrays of batch rows), classified on the host
    (no device reads)."""

    retrieval_rows: np.ndarray = field(default_factory=_rows)
    """Decode rows drafted through a selection."""
    retrieval_slots: np.ndarray = field(default_factory=_rows)
    """Their request slots."""
    due_rows: np.ndarray = field(default_factory=_rows)
    """Retrieval rows whose selection is recomputed this step."""
    due_slots: np.ndarray = field(default_factory=_rows)
    due_causes: np.ndarray = field(default_factory=_rows)
    """Why each due row retrieves (an index into ``REFRESH_CAUSES``)."""
    windowed_prefill_rows: np.ndarray = field(default_factory=_rows)
    """Compact positions: prompt chunks beyond the draft's window, prefilled
    over the sink and the most recent blocks."""
    last_prompt_chunk_rows: np.ndarray = field(default_factory=_rows)
    """cmr with compact positions: the windowed prompt chunks that end the
    prompt; they also attend to the chunks the target's attention picks, so
    the first drafts after the prompt already see them."""
    seq_lens: np.ndarray | None = None
    """``[num_reqs]``: context length including this step's query."""
    private_rows: np.ndarray = field(default_factory=_rows)
    """Rows with a private layout area (retrieval and windowed prefill)."""

    @property
    def empty(self) -> bool:
        return not self.retrieval_rows.size and not self.windowed_prefill_rows.size


@dataclass
class StagedRows:
    """Device index tensors of the classified rows and their request slots."""

    rows: torch.Tensor
    slots: torch.Tensor
    due: torch.Tensor
    due_slots: torch.Tensor
    slot_of_row: torch.Tensor | None = None
    """``[num_reqs]``: each row's request slot if it retrieves, else -1
    (staged for the planner's kernels only)."""


class RequestRows:
    """Per-request state arrays, request tracking and row classification."""

    config: SpecExtendConfig
    stats: RetrievalStats
    max_num_speculative_tokens: int
    draft_window: int
    compact_positions: bool
    private_layouts: PrivateLayouts | None
    _free_areas: list[int]
    layouts_in_place: int

    def __init__(self, max_num_reqs: int) -> None:
        self._requests: dict[str, _RequestState] = {}
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(max_num_reqs))
        # Per request slot, on the host: classification is numpy over these.
        self._decoded = np.zeros(max_num_reqs, dtype=bool)
        """Tracked since a decode step (else only through windowed prefill)."""
        self._steps_since_retrieval = np.zeros(max_num_reqs, dtype=np.int64)
        self._has_selection = np.zeros(max_num_reqs, dtype=bool)
        self._area_of_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        self._refresh_counts = np.zeros((max_num_reqs, len(REFRESH_CAUSES)), dtype=np.int64)

    def _classify_rows(self, batch: PlanningBatch) -> StepRows:
        """Host-side, numpy over per-slot state: which rows retrieve, which
        are due, which prefill windowed; tracks new requests and drops
        prefilling ones."""
        config = self.config
        k = self.max_num_speculative_tokens
        query_lens = np.asarray(batch.query_lens_cpu)
        context_lens = np.asarray(batch.context_lens_cpu)
        prompt_lens = np.asarray(batch.prompt_lens_cpu)
        is_decode = decode_rows(query_lens, context_lens, prompt_lens, k)
        seq_lens = context_lens + query_lens
        # Prefill rows get no retrieval: the draft writes their KV once, and
        # would keep KV computed from partial context for good.
        eligible = is_decode & (seq_lens >= max(config.min_context_tokens, 1))
        # Rows whose draft positions would leave the draft's window.
        beyond_window = seq_lens + k > self.draft_window
        if self.compact_positions:
            eligible |= is_decode & beyond_window
        step = StepRows(seq_lens=seq_lens)
        if not is_decode.all():
            self._classify_prompt_chunks(batch, step, is_decode, beyond_window,
                                         seq_lens >= prompt_lens)

        rows = np.flatnonzero(eligible)
        slots = self._slots_of_rows(batch.req_ids, rows, track=True)
        self._decoded[slots] = True
        self._steps_since_retrieval[slots] += 1
        steps = self._steps_since_retrieval[slots]
        # As core.refresh.refresh_cause: first, then interval, then acceptance.
        causes = np.where(~self._has_selection[slots], _FIRST, np.where(
            steps >= config.retrieval_interval, _INTERVAL, _NO_REFRESH))
        if config.retrieval_refresh == "acceptance":
            self._acceptance_refreshes(batch, rows, steps, causes)
        due = causes != _NO_REFRESH
        step.retrieval_rows, step.retrieval_slots = rows, slots
        step.due_rows, step.due_slots, step.due_causes = rows[due], slots[due], causes[due]
        private = rows[self._area_of_slot[slots] >= 0]
        if step.private_rows.size:
            private = np.sort(np.concatenate((private, step.private_rows)))
        step.private_rows = private
        return step

    def _classify_prompt_chunks(self, batch: PlanningBatch, step: StepRows,
                                is_decode: np.ndarray, beyond_window: np.ndarray,
                                ends_prompt: np.ndarray) -> None:
        """Prompt chunks (few rows a step): a request starts over, or, with
        compact positions beyond the window, prefills windowed."""
        windowed_rows, last_chunk_rows, private_rows = [], [], []
        for row in np.flatnonzero(~is_decode).tolist():
            req_id = batch.req_ids[row]
            windowed = self.compact_positions and bool(beyond_window[row])
            self._forget_unless_prefilling(req_id, windowed)
            if windowed:
                windowed_rows.append(row)
                if self.config.mode == "cmr" and ends_prompt[row]:
                    last_chunk_rows.append(row)
                if self._has_private_area(req_id):
                    private_rows.append(row)
        step.windowed_prefill_rows = np.array(windowed_rows, dtype=np.int64)
        step.last_prompt_chunk_rows = np.array(last_chunk_rows, dtype=np.int64)
        step.private_rows = np.array(private_rows, dtype=np.int64)

    def _slots_of_rows(self, req_ids: list[str], rows: np.ndarray,
                       track: bool = False) -> np.ndarray:
        """The request slots of ``rows`` (``track``: new requests get one)."""
        slots = np.fromiter(map(self._slot_of.get, req_ids, itertools.repeat(-1)),
                            dtype=np.int64, count=len(req_ids))[rows]
        if track:
            for index in np.flatnonzero(slots < 0).tolist():
                slots[index] = self._track(req_ids[rows[index]]).slot
        return slots

    def _acceptance_refreshes(self, batch: PlanningBatch, rows: np.ndarray, steps: np.ndarray,
                              causes: np.ndarray) -> None:
        """``retrieval_refresh: acceptance``: observe each row's acceptance
        and mark the rows whose acceptance dropped (a loop over the rows:
        this option only)."""
        drop = self.config.acceptance_drop
        for index, row in enumerate(rows.tolist()):
            trend = self._requests[batch.req_ids[row]].acceptance
            trend.observe(int(batch.context_lens_cpu[row]), int(batch.query_lens_cpu[row]),
                          int(steps[index]))
            if causes[index] == _NO_REFRESH and trend.dropped(drop):
                causes[index] = _ACCEPTANCE
    def _note_retrievals(self, batch: PlanningBatch, step: StepRows) -> None:
        """Host bookkeeping of the rows that retrieved: new selections, by cause."""
        self._has_selection[step.due_slots] = True
        self._steps_since_retrieval[step.due_slots] = 0
        np.add.at(self._refresh_counts, (step.due_slots, step.due_causes), 1)
        for cause, count in zip(REFRESH_CAUSES, np.bincount(
                step.due_causes, minlength=len(REFRESH_CAUSES)).tolist()):
            self.stats.refreshes[cause] += count
        if self.config.retrieval_refresh == "acceptance":
            for row, cause in zip(step.due_rows.tolist(), step.due_causes.tolist()):
                self._requests[batch.req_ids[row]].acceptance.new_selection(
                    REFRESH_CAUSES[cause])
    def _track(self, req_id: str) -> _RequestState:
        slot = self._free_slots.pop()
        state = _RequestState(slot=slot, refresh_counts=self._refresh_counts[slot])
        if self.private_layouts is not None:
            if self._free_areas:
                state.area = self._free_areas.pop()
            else:
                self.layouts_in_place += 1
        self._decoded[slot] = False
        self._steps_since_retrieval[slot] = 0
        self._has_selection[slot] = False
        self._area_of_slot[slot] = state.area
        state.refresh_counts[:] = 0
        self._requests[req_id] = state
        self._slot_of[req_id] = slot
        return state

    def _forget(self, req_id: str, finished: bool = True) -> None:
        state = self._requests.pop(req_id, None)
        if state is None:
            return
        del self._slot_of[req_id]
        if finished and self._decoded[state.slot]:
            self.stats.finish_request(state.slot)
        else:
            self.stats.clear_slot(state.slot)
        self._free_slots.append(state.slot)
        if state.area >= 0:
            self._free_areas.append(state.area)

    def _forget_unless_prefilling(self, req_id: str, windowed: bool) -> None:
        """A prompt chunk: the request starts over (a preempted request
        recomputes), except that with private layouts a windowed prefill
        keeps the state (and area) its earlier chunks made."""
        state = self._requests.get(req_id)
        if (state is None or not windowed or self.private_layouts is None
                or self._decoded[state.slot]):
            self._forget(req_id)

    def _has_private_area(self, req_id: str) -> bool:
        """With private layouts, a windowed prefill is tracked for its area."""
        if self.private_layouts is None:
            return False
        state = self._requests.get(req_id) or self._track(req_id)
        return state.area >= 0

    def _forget_requests_not_in(self, req_ids: list[str]) -> None:
        """Free the state of finished, aborted or preempted requests."""
        gone = self._requests.keys() - set(req_ids)
        # In tracking order: slots are freed (and reused) deterministically.
        for req_id in [r for r in self._requests if r in gone] if gone else ():
            self._forget(req_id)
