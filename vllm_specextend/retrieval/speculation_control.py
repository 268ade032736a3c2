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
"""

from __future__ import annotations

import time

import numpy as np

from vllm_specextend.core.goodput import DraftPlan, GoodputController


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
    ) -> None:
        """Args:
            free_pause: a step where nobody drafts skips the draft's forward.
            synced_lead: draft KV positions past the verified tokens that a
                forward leaves right (a draft model's writes the sampled
                token's; a head's needs the token after it: 0).
            max_catch_up: most tokens a request catches up (a head: the
                positions whose hidden states are kept).
        """
        self.free_pause = free_pause
        self.synced_lead = synced_lead
        self.max_catch_up = max_catch_up
        self.clock = time.perf_counter
        """Seconds now (tests simulate a device's step costs with it)."""
        self.controller = GoodputController(max_requests, num_speculative_tokens, free_pause)
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

    def plan(
        self,
        req_ids: list[str],
        context_lens: np.ndarray,
        query_lens: np.ndarray,
        prompt_lens: np.ndarray,
    ) -> tuple[DraftPlan, bool]:
        """This step's plan and whether the draft's forward runs."""
        left = set(self._frontier) - set(req_ids)
        self.controller.finish(left)
        for req_id in left:
            del self._frontier[req_id]
        now = self.clock()
        for req_id, context_len in zip(req_ids, context_lens.tolist()):
            frontier = self._frontier.get(req_id)
            if req_id in self._synced:
                # The last forward wrote the verified tokens (and, for a draft
                # model, the token at ``context_len``).
                self._frontier[req_id] = context_len + self.synced_lead
            elif frontier is None or context_len + self.synced_lead < frontier:
                # New, or preempted and recomputed from an earlier point.
                self._frontier[req_id] = context_len
        if self.forced_pause:
            nothing = np.zeros(len(req_ids), dtype=np.int64)
            plan = DraftPlan(nothing, 0, 0.0, nothing)
        else:
            plan = self.controller.plan(req_ids, context_lens, query_lens, prompt_lens, now,
                                        catch_up_gaps=self._gaps(req_ids, context_lens))
        self.draft_lengths = dict(zip(req_ids, plan.draft_lengths.tolist()))
        self._catch_up_limits = (None if plan.catch_up_limits is None
                                 else dict(zip(req_ids, plan.catch_up_limits.tolist())))
        prefilling = bool((context_lens < prompt_lens).any())
        runs = not (self.free_pause and plan.draft_steps == 0 and not prefilling)
        if not self.forced_pause:
            self.controller.record_forwards(max(plan.draft_steps, 1) if runs else 0)
        self._synced = set(req_ids) if runs else set()
        if self.trace is not None:
            self.trace.append({"req_ids": list(req_ids), "context_lens": context_lens.tolist(),
                               "draft_lengths": plan.draft_lengths.tolist(),
                               "draft_forward": runs, "seconds": now})
        return plan, runs

    def catch_up_starts(self, req_ids: list[str], context_lens: np.ndarray,
                        budget: int) -> np.ndarray | None:
        """Per row, the first position the forward must process, or None when
        nothing is caught up: from its draft KV frontier, or its most recent
        tokens within the plan's limit (the row then stays behind its
        frontier) and, for all rows together, ``budget`` tokens (beyond it,
        and beyond a head's kept positions, holes stay holes)."""
        gaps = self._gaps(req_ids, context_lens)
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
        self.controller.record_catch_up(int(gaps.sum()))
        return context_lens - gaps

    def _gaps(self, req_ids: list[str], context_lens: np.ndarray) -> np.ndarray:
        """Per row, the verified tokens its draft KV lacks (a head: at most
        the positions kept)."""
        starts = np.array([self._frontier[r] for r in req_ids], dtype=np.int64)
        gaps = np.maximum(context_lens - starts, 0)
        if self.max_catch_up is not None:
            gaps = np.minimum(gaps, self.max_catch_up)
        return gaps

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
            "chosen_draft_lengths": stats.chosen_lengths.tolist(),
            "request_paused_fraction": stats.request_paused_fraction.as_dict(),
            "requests": self.controller.request_figures(),
        }
