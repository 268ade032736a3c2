"""Goodput control inside a vLLM worker: the controller's per-step plan, the
draft KV frontier of each request, and what the drafter's first pass must
catch up when drafting resumes.

A step in which no request drafts and none is prefilling skips the draft's
forward when the drafter can catch up: a draft model from token ids, an EAGLE
head also from the target's hidden states kept for it
(``paused_hidden_states.py``). The tokens verified meanwhile have no draft
KV; each request's frontier says from where, and the next forward prepends
them to the request's query (``catch_up_starts``), up to the drafter's token budget and, for a head,
the positions kept (older ones stay holes: the draft reads stale KV there,
the target's output does not change).

A request catches up all of its gap only when it drafts on its acceptance
estimates. A probe catches up the recent tokens its budget buys (the plan's
``catch_up_limits``) and a paused request in a forward that runs for others
none; both keep their frontier, so drafting on estimates later catches up the
rest.

Prompts too: when nobody drafts and a caught-up new request would not draft
either (``DraftPlan.draft_prefill``), a step of prompt chunks skips the
draft's forward, and the request starts behind (it resumes on its estimates,
its catch-up priced, or probes once its budget covers all of its gap).
Blocks whose draft KV lacks tokens (deferred prompts, pauses, holes) can
reach the prefix cache: a request whose cache hit holds one starts behind
from it, so its draft never reads them as its own.
"""

from __future__ import annotations

import time

import numpy as np

from vllm_specextend.common.kernel_args import ints
from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.control.draft_lengths import (
    NO_PLANNED_DRAFT_LENGTHS,
    PlannedDraftLengths,
)
from vllm_specextend.control.frontier_kernels import (
    advance_frontiers,
    block_ranges,
    catch_up_rows,
    end_step,
    filled_blocks,
    forget,
    new_rows,
)
from vllm_specextend.control.goodput import DraftPlan, GoodputController, StepOutcome
from vllm_specextend.control.kernel_state import BlockTable, FrontierState
from vllm_specextend.control.parameters import ControlParameters


class SpeculationControl:
    """Per engine step: how many drafts each request gets, and whether the
    draft's forward runs. Per-request state is held in arrays by request
    slot (:class:`RequestSlots`, shared with the controller)."""

    def __init__(
        self,
        max_num_reqs: int,
        num_speculative_tokens: int,
        free_pause: bool,
        synced_lead: int = 1,
        max_catch_up: int | None = None,
        defer_prompts: bool = False,
        full_graph_query_len: int | None = None,
        requests: RequestSlots | None = None,
        parameters: ControlParameters = ControlParameters(),
    ) -> None:
        """Args:
            free_pause: a step where nobody drafts skips the draft's forward.
            synced_lead: draft KV positions past the verified tokens that a
                forward leaves right (a draft model's writes the sampled
                token's; a head's needs the token after it: 0).
            max_catch_up: most tokens a request catches up (a head: the
                positions whose hidden states are kept).
            defer_prompts: a step of prompt chunks may skip the draft's
                forward too (a drafter that can catch up a whole prompt: a
                draft model at the target's positions).
            full_graph_query_len: ``1 + K`` when the target replays FULL CUDA
                graphs for uniform decode steps only: the controller learns
                what leaving them costs (``GoodputController``).
            requests: the drafter's request slots, shared with retrieval
                (None: its own).
            parameters: the controller's tuning.

        (Long for the arguments' and fields' docs: it only assigns.)
        """
        self.free_pause = free_pause
        self.defer_prompts = defer_prompts and free_pause
        self.synced_lead = synced_lead
        self.max_catch_up = max_catch_up
        self.clock = time.perf_counter
        """Seconds now (tests simulate a device's step costs with it)."""
        self.controller = GoodputController(max_num_reqs, num_speculative_tokens, free_pause,
                                            parameters=parameters,
                                            full_graph_query_len=full_graph_query_len,
                                            requests=requests)
        self.controller.requests.subscribe(left=self._forget)
        self.draft_lengths = NO_PLANNED_DRAFT_LENGTHS
        """Drafts each request of the last plan keeps (the runner truncates to them)."""
        self._limits: tuple[list[str], np.ndarray] | None = None
        """The last plan's requests and catch-up limits (None: no limits)."""
        self.kv_state = FrontierState.new(max_num_reqs)
        """Each request's draft KV frontier, by slot (``FrontierState``). A
        deferred request (its draft prefill skipped) is probed with all of
        its gap (with holes in the prompt a probe would not measure the
        draft). A lagging one, left behind its frontier by the last step, has
        its blocks from the frontier's on turn stale when it leaves behind; a
        prefix hit on them meanwhile is stale too."""
        self._blocks: BlockTable | None = None
        """This step's host block table rows and block size (None: not kept)."""
        self._stale_blocks: set[int] = set()
        """KV blocks whose draft KV lacks tokens the target wrote, left so by
        requests that finished behind their frontier or caught up with holes:
        a request that finds one in the prefix cache catches up from it."""
        self._holes: list[int] = []
        """Blocks this step's catch-up leaves holes in (stale from the next plan)."""

    def plan(
        self,
        req_ids: list[str],
        context_lens: np.ndarray,
        query_lens: np.ndarray,
        prompt_lens: np.ndarray,
        block_table: np.ndarray | None = None,
        block_size: int = 0,
    ) -> tuple[DraftPlan, bool]:
        """This step's plan and whether the draft's forward runs
        (``block_table``: the rows' KV block ids on the host, to keep prefix
        cache hits on blocks without the draft's KV right; None: not kept)."""
        self._blocks = (None if block_table is None
                        else BlockTable(_table(block_table), int(block_size)))
        slots = self.controller.admit(req_ids)
        now = self.clock()
        context_lens, query_lens = ints(context_lens), ints(query_lens)
        starts, gaps, whole, prefilling = self._advance_frontiers(slots, context_lens,
                                                                  ints(prompt_lens))
        plan = self.controller.plan(req_ids, context_lens, query_lens, prompt_lens, now,
                                    catch_up_gaps=gaps, whole_catch_up=whole)
        planned = list(req_ids)
        self.draft_lengths = PlannedDraftLengths(planned, plan.draft_lengths)
        self._limits = None if plan.catch_up_limits is None else (planned, plan.catch_up_limits)
        runs = not (self.free_pause and plan.draft_steps == 0 and not (
            prefilling and (plan.draft_prefill or not self.defer_prompts)))
        deferred_tokens = 0
        if prefilling and not runs:
            # A caught-up request would not draft now: its prompt waits.
            prefilling_rows = context_lens < prompt_lens
            self.kv_state.deferred[slots[prefilling_rows]] = True
            deferred_tokens = int(query_lens[prefilling_rows].sum())
        self.controller.observe(StepOutcome(
            draft_forwards=max(plan.draft_steps, 1) if runs else 0,
            deferred_prefill_tokens=deferred_tokens))
        self._end_step(slots, runs, starts, context_lens, query_lens, plan.catch_up_limits, gaps)
        return plan, runs

    def _forget(self, left: list[str], slots: np.ndarray) -> None:
        """Requests that left the batch: the blocks of one that left behind
        its frontier turn stale."""
        stale = forget(slots, self.kv_state)
        if stale.size:
            self._stale_blocks.update(stale.tolist())

    def _advance_frontiers(self, slots: np.ndarray, context_lens: np.ndarray,
                           prompt_lens: np.ndarray) -> tuple:
        """Each request's draft KV frontier after the last step; blocks the
        last forward filled leave the stale set, its holes join it. Returns
        per row its frontier, its gap (the verified tokens its draft KV
        lacks, for a head at most the positions kept) and whether its
        prompt was deferred, and whether a row is prefilling."""
        new = new_rows(slots, self.kv_state)
        new_starts = np.empty(len(new), dtype=np.int64)
        if self._stale_blocks and self._blocks is not None:
            # The last forward wrote the verified tokens (and, for a draft
            # model, the token at ``context_len``): in row order, as a new
            # request's first stale block is looked up among them.
            start = 0
            for i, row in enumerate([*new.tolist(), len(slots)]):
                self._stale_blocks.difference_update(filled_blocks(
                    self._blocks, slots, context_lens, self.kv_state, self.synced_lead, start,
                    row).tolist())
                if row < len(slots):
                    new_starts[i] = self._first_stale(row, int(context_lens[row]))
                start = row
        else:
            for i, row in enumerate(new.tolist()):
                new_starts[i] = self._first_stale(row, int(context_lens[row]))
        frontiers = advance_frontiers(
            slots, context_lens, prompt_lens, new_starts, self.kv_state, self.synced_lead,
            -1 if self.max_catch_up is None else self.max_catch_up)
        self._stale_blocks.update(self._holes)
        self._holes = []
        return frontiers

    def _first_stale(self, row: int, context_len: int) -> int:
        """New: its draft KV is right up to ``context_len``, or up to the
        start of the first block before it whose draft KV is stale (left so,
        or lagging in a live request) that its prefix cache hit holds."""
        if self._blocks is None or not context_len:
            return context_len
        state = self.kv_state
        lagging = np.flatnonzero(state.lagging)
        if not (self._stale_blocks or lagging.size):
            return context_len
        table, size = self._blocks
        stale = np.fromiter(self._stale_blocks, dtype=np.int64)
        live = block_ranges(state.lag_table, lagging, state.lag_start[lagging],
                            state.lag_end[lagging])
        hits = np.flatnonzero(np.isin(table[row, :-(-context_len // size)],
                                      np.concatenate([stale, live])))
        return int(hits[0]) * size if hits.size else context_len

    def _end_step(self, slots: np.ndarray, runs: bool, starts: np.ndarray,
                  context_lens: np.ndarray, query_lens: np.ndarray, limits: np.ndarray | None,
                  gaps: np.ndarray) -> None:
        """Only the requests of a forward that runs are synced; with block
        tables kept, per request left behind its frontier (``starts``) by
        this step (its forward did not run, or its catch-up ``limits``
        leave part of its ``gaps``): its blocks from the frontier's on (the
        others' are written by this step). One compiled call
        (:func:`~vllm_specextend.control.frontier_kernels.end_step`)."""
        blocks = _NO_TABLE if self._blocks is None else self._blocks
        width = blocks.table.shape[1]
        if self._blocks is not None and self.kv_state.lag_table.shape[1] != width:
            self.kv_state = self.kv_state._replace(
                lag_table=np.zeros((len(self.kv_state.lagging), width), dtype=np.int64))
        end_step(slots, runs, self.kv_state, blocks, starts, context_lens + query_lens,
                 _NO_LIMITS if limits is None else limits, gaps)

    def catch_up_starts(self, req_ids: list[str], context_lens: np.ndarray,
                        budget: int) -> np.ndarray | None:
        """Per row, the first position this step's first pass processes (None:
        nothing is caught up): from its draft KV frontier, or its most recent
        tokens within the plan's limit and, for all rows together, ``budget``
        tokens (beyond it, and beyond a head's kept positions, holes stay
        holes). Rows left short keep their frontier (they are no longer
        synced), the holes turn stale at the next plan, and the controller
        learns the tokens' cost."""
        slots = self.controller.slots(req_ids)
        limits = _NO_LIMITS
        if self._limits is not None:
            plan_ids, limits = self._limits
            if req_ids != plan_ids:
                limit_of = dict(zip(plan_ids, limits.tolist()))
                limits = np.array([limit_of[r] for r in req_ids], dtype=np.int64)
        starts, tokens, holes = catch_up_rows(
            slots, ints(context_lens), self.kv_state,
            -1 if self.max_catch_up is None else self.max_catch_up, limits, budget,
            _NO_TABLE if self._blocks is None else self._blocks)
        if tokens < 0:
            return None
        self._holes += holes.tolist()
        self.controller.observe(StepOutcome(catch_up_tokens=tokens))
        return starts

    def frontiers(self, req_ids: list[str]) -> np.ndarray:
        """Per row, its draft KV frontier (every position before it is right)."""
        return self.kv_state.frontier[self.controller.slots(req_ids)]

    def slots(self, req_ids: list[str]) -> np.ndarray:
        """Each planned request's slot (``0 .. max_num_reqs - 1``)."""
        return self.controller.slots(req_ids)

    def metrics_snapshot(self) -> dict[str, object]:
        stats = self.controller.stats
        return {
            "drafted_request_steps": stats.drafted_request_steps,
            "paused_request_steps": stats.paused_request_steps,
            "probes": stats.probes,
            "explorations": stats.explorations,
            "skipped_draft_forwards": stats.skipped_draft_forwards,
            "catch_up_tokens": stats.catch_up_tokens,
            "deferred_prefill_tokens": stats.deferred_prefill_tokens,
            "chosen_draft_lengths": stats.chosen_lengths.tolist(),
            "request_paused_fraction": stats.request_paused_fraction.as_dict(),
            "requests": self.controller.request_figures(),
        }



_NO_LIMITS = np.zeros(0, dtype=np.int64)
_NO_TABLE = BlockTable(np.zeros((0, 0), dtype=np.int64), 1)


def _table(block_table: np.ndarray) -> np.ndarray:
    """A host block table as the kernels take it: contiguous, int32 (vLLM's)
    or int64 (no copy when already so)."""
    dtype = block_table.dtype if block_table.dtype in (np.int32, np.int64) else np.int64
    return np.ascontiguousarray(block_table, dtype=dtype)
