"""The planner's per-request state and its classification of a step's rows.

The planner's state lives in per-slot host arrays, by the drafter's request
slots (``common/request_slots.py``, shared with goodput control): tracked,
decoded yet, steps since its last retrieval, selection made, private area,
retrievals by cause. A request is tracked from its first retrieval row (or
windowed prompt chunk with private layouts) until it leaves the batch or
starts over. :meth:`RequestRows._classify_rows` runs compiled loops over
those arrays (``retrieval/row_kernels.py``; no device reads): which rows retrieve,
which are due, which prefill windowed.
:class:`RequestRows` is a base of :class:`~vllm_specextend.retrieval.planner.RetrievalPlanner`,
which sets the attributes annotated below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.retrieval.counters import RetrievalStats
from vllm_specextend.retrieval.draft_view import PrivateLayouts
from vllm_specextend.retrieval.refresh import REFRESH_CAUSES, AcceptanceTrend
from vllm_specextend.retrieval.row_kernels import (
    NO_REFRESH,
    RetrievalRowState,
    RowLengths,
    RowRules,
    classify_rows,
    classify_step,
    note_retrievals,
    reset_slots,
    warm_up_row_kernels,
)


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
    return classify_rows(RowLengths.of(query_lens, context_lens, prompt_lens),
                         RowRules.of(max_num_speculative_tokens, 1, 0, False, 1))[1]


_ACCEPTANCE = REFRESH_CAUSES.index("acceptance")


_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_ROWS.flags.writeable = False


def _rows() -> np.ndarray:
    """No rows (one shared read-only array: a step builds a dozen defaults)."""
    return _NO_ROWS


@dataclass(slots=True)
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
    slots: np.ndarray = field(default_factory=_rows)
    """``[num_reqs]``: each row's request slot."""
    private_rows: np.ndarray = field(default_factory=_rows)
    """Rows with a private layout area (retrieval and windowed prefill)."""

    @property
    def empty(self) -> bool:
        return not self.retrieval_rows.size and not self.windowed_prefill_rows.size


@dataclass(slots=True)
class StagedRows:
    """Device index tensors of the classified rows and their request slots."""

    rows: torch.Tensor
    slots: torch.Tensor
    due: torch.Tensor
    due_slots: torch.Tensor
    slot_of_row: torch.Tensor | None = None
    """``[num_reqs]``: each row's request slot if it retrieves, else -1
    (staged for the planner's kernels only)."""
    due_of_row: torch.Tensor | None = None
    """``[num_reqs]``: 1 where the row's selection is recomputed this step
    (kernels only)."""


class RequestRows:
    """Per-slot request state, request tracking and row classification."""

    config: SpecExtendConfig
    stats: RetrievalStats
    max_num_speculative_tokens: int
    draft_window: int
    compact_positions: bool
    private_layouts: PrivateLayouts | None
    _free_areas: list[int]
    layouts_in_place: int
    _drop_scores: Callable[[int], None]
    """From :class:`~vllm_specextend.retrieval.chunk_scoring.ChunkScoring`."""

    def __init__(self, requests: RequestSlots) -> None:
        self.requests = requests
        requests.subscribe(left=self._requests_left)
        capacity = requests.capacity
        self._rows = RetrievalRowState.new(capacity)
        """Per request slot, on the host: classification loops over these."""
        self._acceptance: list[AcceptanceTrend | None] = [None] * capacity
        """Observed only with ``retrieval_refresh: acceptance``."""
        self._step_refreshes = np.zeros(len(REFRESH_CAUSES), dtype=np.int64)
        """A step's retrievals by cause."""
        warm_up_row_kernels()

    def _row_rules(self) -> RowRules:
        """The configuration's rules for a row (read each step: the
        benchmarks reconfigure a planner between runs)."""
        config = self.config
        # Prefill rows get no retrieval: the draft writes their KV once,
        # and would keep KV computed from partial context for good.
        return RowRules.of(self.max_num_speculative_tokens, max(config.min_context_tokens, 1),
                           self.draft_window, self.compact_positions, config.retrieval_interval)

    def _classify_rows(self, batch: PlanningBatch, slots: np.ndarray) -> StepRows:
        """Host-side, over per-slot state (``slots``: the rows'), compiled
        (``retrieval/row_kernels.py``): which rows retrieve, which are due, which
        prefill windowed; tracks new requests, drops prefilling ones, and
        notes the retrievals of the rows due (they retrieve this step)."""
        config = self.config
        acceptance = config.retrieval_refresh == "acceptance"
        counts = self._step_refreshes
        counts.fill(0)
        (seq_lens, is_decode, beyond_window, prompt_chunks, rows, retrieval_slots, causes,
         due_rows, due_slots, due_causes, new) = classify_step(
            RowLengths.of(batch.query_lens_cpu, batch.context_lens_cpu, batch.prompt_lens_cpu),
            slots, self._row_rules(), self._rows, not acceptance, counts)
        # Every field given: no default factory runs.
        step = StepRows(retrieval_rows=rows, retrieval_slots=retrieval_slots, due_rows=due_rows,
                        due_slots=due_slots, due_causes=due_causes,
                        windowed_prefill_rows=_NO_ROWS, last_prompt_chunk_rows=_NO_ROWS,
                        seq_lens=seq_lens, slots=slots, private_rows=_NO_ROWS)
        if prompt_chunks:
            self._classify_prompt_chunks(step, slots, is_decode, beyond_window,
                                         seq_lens >= batch.prompt_lens_cpu)
        if new.size:
            self._start_tracking(new)
        if acceptance:
            self._acceptance_refreshes(batch, rows, retrieval_slots, causes)
            due = np.flatnonzero(causes != NO_REFRESH)
            step.due_rows, step.due_slots, step.due_causes = (
                rows[due], retrieval_slots[due], causes[due])
            self._note_retrievals(step)
        elif due_rows.size:
            refreshes = self.stats.refreshes
            for cause, count in zip(REFRESH_CAUSES, counts.tolist()):
                refreshes[cause] += count
        if self.private_layouts is not None:
            private = rows[self._rows.area_of_slot[retrieval_slots] >= 0]
            if step.private_rows.size:
                private = np.sort(np.concatenate((private, step.private_rows)))
            step.private_rows = private
        return step

    def _classify_prompt_chunks(self, step: StepRows, slots: np.ndarray,
                                is_decode: np.ndarray, beyond_window: np.ndarray,
                                ends_prompt: np.ndarray) -> None:
        """Prompt chunks (few rows a step): a request starts over, or, with
        compact positions beyond the window, prefills windowed."""
        if not self.compact_positions:  # nothing prefills windowed
            prompt_slots = slots[~is_decode]
            for slot in prompt_slots[self._rows.tracked[prompt_slots]].tolist():
                self._forget(slot)
            return
        windowed_rows, last_chunk_rows, private_rows = [], [], []
        for row in np.flatnonzero(~is_decode).tolist():
            slot = int(slots[row])
            windowed = self.compact_positions and bool(beyond_window[row])
            self._forget_unless_prefilling(slot, windowed)
            if windowed:
                windowed_rows.append(row)
                if self.config.mode == "cmr" and ends_prompt[row]:
                    last_chunk_rows.append(row)
                if self._has_private_area(slot):
                    private_rows.append(row)
        step.windowed_prefill_rows = np.array(windowed_rows, dtype=np.int64)
        step.last_prompt_chunk_rows = np.array(last_chunk_rows, dtype=np.int64)
        step.private_rows = np.array(private_rows, dtype=np.int64)

    def _acceptance_refreshes(self, batch: PlanningBatch, rows: np.ndarray, slots: np.ndarray,
                              causes: np.ndarray) -> None:
        """``retrieval_refresh: acceptance``: observe each row's acceptance
        and mark the rows whose acceptance dropped (a loop over the rows:
        this option only)."""
        drop = self.config.acceptance_drop
        steps = self._rows.steps_since_retrieval[slots].tolist()
        for index, (row, slot) in enumerate(zip(rows.tolist(), slots.tolist())):
            trend = self._acceptance[slot]
            trend.observe(int(batch.context_lens_cpu[row]), int(batch.query_lens_cpu[row]),
                          steps[index])
            if causes[index] == NO_REFRESH and trend.dropped(drop):
                causes[index] = _ACCEPTANCE

    def _note_retrievals(self, step: StepRows) -> None:
        """Host bookkeeping of the rows due (they retrieve this step): new
        selections, by cause (``retrieval_refresh: acceptance``; otherwise
        :func:`~vllm_specextend.retrieval.row_kernels.classify_step` notes them)."""
        counts = np.zeros(len(REFRESH_CAUSES), dtype=np.int64)
        note_retrievals(step.due_slots, step.due_causes, self._rows, counts)
        for cause, count in zip(REFRESH_CAUSES, counts.tolist()):
            self.stats.refreshes[cause] += count
        if self.config.retrieval_refresh == "acceptance":
            for slot, cause in zip(step.due_slots.tolist(), step.due_causes.tolist()):
                self._acceptance[slot].new_selection(REFRESH_CAUSES[cause])

    def _track(self, slots: np.ndarray) -> None:
        """Start tracking the requests in ``slots``: fresh state, and a
        private area each while one is free."""
        reset_slots(slots, self._rows)
        self._start_tracking(slots)

    def _start_tracking(self, slots: np.ndarray) -> None:
        """Requests just reset: a private area each while one is free, and
        an acceptance trend with ``retrieval_refresh: acceptance``."""
        if self.private_layouts is not None:
            for slot in slots.tolist():
                if self._free_areas:
                    self._rows.area_of_slot[slot] = self._free_areas.pop()
                else:
                    self.layouts_in_place += 1
        if self.config.retrieval_refresh == "acceptance":
            for slot in slots.tolist():
                self._acceptance[slot] = AcceptanceTrend()

    def _forget(self, slot: int, finished: bool = True) -> None:
        """Stop tracking the request in ``slot`` (its figures are kept as a
        finished request's if it decoded)."""
        self._rows.tracked[slot] = False
        if finished and self._rows.decoded[slot]:
            self.stats.finish_request(slot)
        else:
            self.stats.clear_slot(slot)
        self._drop_scores(slot)
        area = int(self._rows.area_of_slot[slot])
        if area >= 0:
            self._free_areas.append(area)
            self._rows.area_of_slot[slot] = -1

    def _forget_all(self, finished: bool = True) -> None:
        for slot in np.flatnonzero(self._rows.tracked).tolist():
            self._forget(slot, finished)

    def _forget_unless_prefilling(self, slot: int, windowed: bool) -> None:
        """A prompt chunk: the request starts over (a preempted request
        recomputes), except that with private layouts a windowed prefill
        keeps the state (and area) its earlier chunks made."""
        if self._rows.tracked[slot] and (not windowed or self.private_layouts is None
                                    or self._rows.decoded[slot]):
            self._forget(slot)

    def _has_private_area(self, slot: int) -> bool:
        """With private layouts, a windowed prefill is tracked for its area."""
        if self.private_layouts is None:
            return False
        if not self._rows.tracked[slot]:
            self._track(np.array([slot]))
        return bool(self._rows.area_of_slot[slot] >= 0)

    def _requests_left(self, req_ids: list[str], slots: np.ndarray) -> None:
        """Finished, aborted or preempted requests (``RequestSlots`` tells,
        in arrival order): their state is freed."""
        for slot in slots[self._rows.tracked[slots]].tolist():
            self._forget(slot)

    def tracked_requests(self) -> dict[str, int]:
        """The requests tracked, by id, and their slots."""
        tracked = self._rows.tracked
        return {req_id: slot for req_id, slot in self.requests.items() if tracked[slot]}
