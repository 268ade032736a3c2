"""Goodput control inside a vLLM worker: the controller's per-step plan, the
draft KV frontier of each request, and what the drafter's first pass must
catch up when drafting resumes.

A step in which no request drafts and none is prefilling skips the draft's
forward when the drafter can catch up: a draft model from token ids, an EAGLE
head also from the target's hidden states kept for it
(``paused_hidden_states.py``). The tokens verified meanwhile have no draft
KV; each request's frontier says from where, and the next forward prepends
them to the request's query (``catch_up_starts``), up to the drafter's token
budget and, for a head, the positions kept (older ones stay holes: the draft
reads stale KV there, the target's output does not change).

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

from vllm_specextend.core.goodput import DraftPlan, GoodputController, StepOutcome


class SpeculationControl:
    """Per engine step: how many drafts each request gets, and whether the
    draft's forward runs."""

    def __init__(
        self,
        max_requests: int,
        num_speculative_tokens: int,
        free_pause: bool,
        synced_lead: int = 1,
        max_catch_up: int | None = None,
        defer_prompts: bool = False,
        full_graph_query_len: int | None = None,
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
        """
        self.free_pause = free_pause
        self.defer_prompts = defer_prompts and free_pause
        self.synced_lead = synced_lead
        self.max_catch_up = max_catch_up
        self.clock = time.perf_counter
        """Seconds now (tests simulate a device's step costs with it)."""
        self.controller = GoodputController(max_requests, num_speculative_tokens, free_pause,
                                            full_graph_query_len=full_graph_query_len)
        self.draft_lengths: dict[str, int] = {}
        """Drafts each request of the last plan keeps (the runner truncates to them)."""
        self._catch_up_limits: dict[str, int] | None = None
        self.trace: list[dict[str, object]] | None = None
        """Set to a list to record every plan and the clock at it (benchmarks:
        K and step seconds over time)."""
        self.forced_pause = False
        """Benchmarks: every request pauses and the controller neither plans
        nor learns (the floor of a speculative engine that never drafts)."""
        self._frontier: dict[str, int] = {}
        self._synced: set[str] = set()
        self._deferred: set[str] = set()
        """Requests whose draft prefill was deferred, until caught up (a probe
        catches up all of their gap: with holes in the prompt it would not
        measure the draft)."""
        self._blocks: tuple[np.ndarray, int] | None = None
        """This step's host block table rows and block size (None: not kept)."""
        self._stale_blocks: set[int] = set()
        """KV blocks whose draft KV lacks tokens the target wrote, left so by
        requests that finished behind their frontier or caught up with holes:
        a request that finds one in the prefix cache catches up from it."""
        self._lagging_blocks: dict[str, np.ndarray] = {}
        """Per live request: its blocks from its frontier's on (stale when it
        leaves behind; a prefix hit on them meanwhile is stale too)."""
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
        self._blocks = None if block_table is None else (block_table, block_size)
        left = set(self._frontier) - set(req_ids)
        self.controller.finish(left)
        for req_id in left:
            lagging = self._lagging_blocks.pop(req_id, None)
            if lagging is not None and req_id not in self._synced:
                self._stale_blocks.update(lagging.tolist())
            del self._frontier[req_id]
            self._deferred.discard(req_id)
        now = self.clock()
        self._advance_frontiers(req_ids, context_lens)
        prefilling_rows = context_lens < prompt_lens
        starts = self._frontiers(req_ids)
        gaps = self._capped(np.maximum(context_lens - starts, 0))
        if self.forced_pause:
            nothing = np.zeros(len(req_ids), dtype=np.int64)
            plan = DraftPlan(nothing, 0, 0.0, nothing)
        else:
            deferred = np.array([r in self._deferred for r in req_ids], dtype=bool)
            plan = self.controller.plan(req_ids, context_lens, query_lens, prompt_lens, now,
                                        catch_up_gaps=gaps, whole_catch_up=deferred)
        self.draft_lengths = dict(zip(req_ids, plan.draft_lengths.tolist()))
        self._catch_up_limits = (None if plan.catch_up_limits is None
                                 else dict(zip(req_ids, plan.catch_up_limits.tolist())))
        prefilling = bool(prefilling_rows.any())
        runs = not (self.free_pause and plan.draft_steps == 0 and not (
            prefilling and (plan.draft_prefill or not self.defer_prompts)))
        deferred_tokens = 0
        if prefilling and not runs:
            # A caught-up request would not draft now: its prompt waits.
            self._deferred.update(r for r, p in zip(req_ids, prefilling_rows) if p)
            deferred_tokens = int(np.where(prefilling_rows, query_lens, 0).sum())
        if not self.forced_pause:
            self.controller.observe(StepOutcome(
                draft_forwards=max(plan.draft_steps, 1) if runs else 0,
                deferred_prefill_tokens=deferred_tokens))
        self._synced = set(req_ids) if runs else set()
        if self._blocks is not None:
            seq_lens = context_lens + query_lens
            behind = starts < seq_lens
            if runs:
                limits = plan.catch_up_limits
                behind &= False if limits is None else limits < gaps
            self._keep_lagging_blocks(req_ids, seq_lens, behind)
        if self.trace is not None:
            self.trace.append({"req_ids": list(req_ids), "context_lens": context_lens.tolist(),
                               "draft_lengths": plan.draft_lengths.tolist(),
                               "draft_forward": runs, "seconds": now})
        return plan, runs

    def _advance_frontiers(self, req_ids: list[str], context_lens: np.ndarray) -> None:
        """Each request's draft KV frontier after the last step; blocks the
        last forward filled leave the stale set, its holes join it."""
        blocks = self._blocks
        for row, (req_id, context_len) in enumerate(zip(req_ids, context_lens.tolist())):
            frontier = self._frontier.get(req_id)
            if req_id in self._synced:
                # The last forward wrote the verified tokens (and, for a draft
                # model, the token at ``context_len``).
                synced = context_len + self.synced_lead
                if self._stale_blocks and blocks is not None and frontier is not None:
                    table, size = blocks
                    self._stale_blocks.difference_update(
                        table[row, frontier // size:synced // size].tolist())
                self._frontier[req_id] = synced
                self._deferred.discard(req_id)
            elif frontier is None:
                # New: its draft KV is right up to its computed tokens, or up
                # to the first stale block its prefix cache hit holds.
                self._frontier[req_id] = self._first_stale(row, context_len)
            elif context_len + self.synced_lead < frontier:
                # Preempted and recomputed from an earlier point.
                self._frontier[req_id] = context_len
        self._stale_blocks.update(self._holes)
        self._holes = []

    def _first_stale(self, row: int, context_len: int) -> int:
        """``context_len``, or the start of the first block before it whose
        draft KV is stale (left so, or lagging in a live request)."""
        if self._blocks is None or not context_len:
            return context_len
        if not (self._stale_blocks or self._lagging_blocks):
            return context_len
        table, size = self._blocks
        stale = np.fromiter(self._stale_blocks, dtype=np.int64)
        lagging = np.concatenate([stale, *self._lagging_blocks.values()])
        hits = np.flatnonzero(np.isin(table[row, :-(-context_len // size)], lagging))
        return int(hits[0]) * size if hits.size else context_len

    def _keep_lagging_blocks(self, req_ids: list[str], seq_lens: np.ndarray,
                             behind: np.ndarray) -> None:
        """Per request left ``behind`` its frontier by this step: its blocks
        from the frontier's on (the others' are written by this step)."""
        table, size = self._blocks
        lagging = {}
        for row in np.flatnonzero(behind).tolist():
            req_id = req_ids[row]
            lagging[req_id] = table[row, self._frontier[req_id] // size:
                                    -(-int(seq_lens[row]) // size)].copy()
        self._lagging_blocks = lagging

    def catch_up_starts(self, req_ids: list[str], context_lens: np.ndarray,
                        budget: int) -> np.ndarray | None:
        """Per row, the first position the forward must process, or None when
        nothing is caught up: from its draft KV frontier, or its most recent
        tokens within the plan's limit (the row then stays behind its
        frontier) and, for all rows together, ``budget`` tokens (beyond it,
        and beyond a head's kept positions, holes stay holes)."""
        full_gaps = np.maximum(context_lens - self._frontiers(req_ids), 0)
        gaps = self._capped(full_gaps)
        if self._catch_up_limits is not None:
            limits = np.array([self._catch_up_limits[r] for r in req_ids], dtype=np.int64)
            behind = limits < gaps
            self._synced.difference_update(r for r, b in zip(req_ids, behind) if b)
            gaps = np.minimum(gaps, limits)
        if not gaps.any():
            return None
        total = int(gaps.sum())
        if total > budget:
            gaps = np.minimum(gaps, max(budget // len(req_ids), 0))
        if self._blocks is not None:
            # Synced with older tokens left out: their blocks turn stale.
            table, size = self._blocks
            for row in np.flatnonzero(gaps < full_gaps).tolist():
                if req_ids[row] not in self._synced:
                    continue  # behind: it keeps its frontier
                first_written = int(context_lens[row] - gaps[row])
                self._holes += table[row, int(context_lens[row] - full_gaps[row]) // size:
                                     -(-first_written // size)].tolist()
        self.controller.observe(StepOutcome(catch_up_tokens=int(gaps.sum())))
        return context_lens - gaps

    def _frontiers(self, req_ids: list[str]) -> np.ndarray:
        """Per row, its draft KV frontier (every position before it is right)."""
        return np.array([self._frontier[r] for r in req_ids], dtype=np.int64)

    def _capped(self, gaps: np.ndarray) -> np.ndarray:
        """The gaps (verified tokens a row's draft KV lacks) a catch-up can
        fill: for a head, at most the positions kept."""
        return gaps if self.max_catch_up is None else np.minimum(gaps, self.max_catch_up)

    def slots(self, req_ids: list[str]) -> np.ndarray:
        """Each planned request's slot (``0 .. max_requests - 1``)."""
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
