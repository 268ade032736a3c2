"""The one object that owns goodput control for a drafter.

A drafter adapter (``drafters/``) holds a :class:`DraftControl` beside its
``DraftRetrieval`` (either may be absent) and calls it at three points:

- construction: the engine's :class:`SpeculationControl`, built once with
  what the drafter can catch up (a draft model from token ids, an EAGLE head
  also from the target's hidden states kept for it);
- model load (:meth:`~DraftControl.allocate_paused_hidden_states`): a head's
  ring of the target's recent hidden states, before vLLM measures memory;
- every proposal: :meth:`~DraftControl.plan` (each request's drafts, and
  whether the draft's forward runs at all), then
  :meth:`~DraftControl.catch_up` (the tokens verified while the draft's
  forward was skipped, staged for the first pass; the V1 adapter puts them
  into the runner's inputs, ``drafters/v1_catch_up.py``).

Control never calls back into the adapter: the adapter hands it the
runner's host state it needs (block table, token ids) as arguments.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.common.staging import IndexStager
from vllm_specextend.control.catch_up import CatchUp, catch_up_layout
from vllm_specextend.control.draft_lengths import PlannedDraftLengths
from vllm_specextend.control.goodput import MAX_PROBE_BACKOFF, PROBE_INTERVAL
from vllm_specextend.control.paused_hidden_states import PausedHiddenStates
from vllm_specextend.control.speculation_control import SpeculationControl
from vllm_specextend.control.warm_up import warm_up_control
from vllm_specextend.log import plugin_logger

logger = plugin_logger(__name__)


class DraftControl:
    """Goodput control of one drafter: the engine's :class:`SpeculationControl`,
    an EAGLE head's kept hidden states, and the host staging of both."""

    def __init__(
        self,
        *,
        method: str,
        num_speculative_tokens: int,
        keeps_hidden_states: bool,
        compact_positions: bool,
        steps_in_flight: int,
        max_num_reqs: int,
        max_num_tokens: int,
        device: torch.device,
        requests: RequestSlots | None = None,
        full_graph_query_len: int | None = None,
    ) -> None:
        """Args:
            method: vLLM's speculative method.
            keeps_hidden_states: the drafter is fed the target's hidden
                states (an EAGLE head): a pause keeps them for its catch-up.
            full_graph_query_len: see :meth:`set_full_graph_query_len`
                (an engine's is known only once its attention backends are).
            requests: the drafter's request slots, shared with retrieval
                (None: its own).
        """
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = device
        # A request paused longer is caught up from its last positions
        # (older ones stay holes); its next probe comes sooner than that.
        self.hidden_capacity = (
            MAX_PROBE_BACKOFF * PROBE_INTERVAL + num_speculative_tokens + 1
            if keeps_hidden_states else 0)
        self.paused_hidden: PausedHiddenStates | None = None
        """An EAGLE head's recent inputs, for its catch-up (model load)."""
        is_draft_model = method == "draft_model"
        warm_up_control()  # compiled (or loaded) now, not at the first step
        self.speculation: SpeculationControl | None = SpeculationControl(
            max_num_reqs, num_speculative_tokens,
            # A draft model catches up from token ids; a head also needs
            # the target's hidden states of the skipped tokens.
            free_pause=is_draft_model or keeps_hidden_states,
            # A draft model's forward also writes the sampled token's KV;
            # a head's needs the token after it.
            synced_lead=1 if is_draft_model else 0,
            max_catch_up=(self.hidden_capacity - num_speculative_tokens - 1
                          if keeps_hidden_states else None),
            # A prompt at compact positions is prefilled in chunks the
            # window allows; a head keeps only recent hidden states.
            defer_prompts=is_draft_model and not compact_positions,
            full_graph_query_len=full_graph_query_len,
            requests=requests,
        )
        """The engine's controller (None: switched off, which the benchmarks
        do between runs: ``benchmarks/worker_hooks.py``)."""
        # Host-built indices (kept hidden states, catch-up layout): eight
        # lists a step, each at most a step's tokens.
        self._host_staging = IndexStager(
            max(max_num_tokens, max_num_reqs + 1), device,
            depth=max(2, steps_in_flight), lists_per_step=8)

    def set_full_graph_query_len(self, full_graph_query_len: int | None) -> None:
        """The query length of every request in a decode step that replays the
        target's FULL CUDA graphs (``1 + K``; None: none), read once vLLM has
        settled its graph mode: its runner may change it when it sets up the
        attention backends, after the drafter is built."""
        if self.speculation is not None:
            self.speculation.controller.set_full_graph_query_len(full_graph_query_len)

    def allocate_paused_hidden_states(self, width: int, dtype: torch.dtype) -> None:
        """At model load, for a drafter fed the target's hidden states (an
        EAGLE head): keep the recent ones, so that a pause skips the head's
        forward too and a later forward catches up."""
        assert self.hidden_capacity, "built for a drafter that keeps no hidden states"
        self.paused_hidden = PausedHiddenStates(
            self.max_num_reqs, self.hidden_capacity, width, dtype, self.device)
        logger.info(
            "SpecExtend: goodput control keeps the target's hidden states of the last %d "
            "positions per request for the head (%.1f MiB)", self.hidden_capacity,
            self.paused_hidden.states.numel() * self.paused_hidden.states.element_size() / 2**20)

    # ---- per step ---------------------------------------------------------

    def plan(self, batch: PlanningBatch, block_table: np.ndarray, block_size: int,
             target_hidden_states: torch.Tensor | None) -> int | None:
        """This step's plan: the most drafts a request keeps, or None when
        nobody drafts (no forward, no retrieval: caught up later).
        ``block_table``: the runner's host block table of the step's rows."""
        assert self.speculation is not None
        plan, runs = self.speculation.plan(
            batch.req_ids, batch.context_lens_cpu, batch.query_lens_cpu,
            batch.prompt_lens_cpu, block_table, block_size)
        self._host_staging.next_step()
        # Kept every step: a request may catch up later what a forward that
        # ran left behind it (paused, or probing a part of its gap).
        if self.paused_hidden is not None:
            token_slots = np.repeat(self.speculation.slots(batch.req_ids), batch.query_lens_cpu)
            self.paused_hidden.record(self._host_staging(token_slots), batch.positions,
                                      target_hidden_states)
        return plan.draft_steps if runs else None

    def catch_up(self, batch: PlanningBatch, token_ids_cpu: np.ndarray) -> CatchUp | None:
        """What this step's first pass catches up, staged on the device: per
        row, the tokens verified while the draft's forward was skipped (its
        KV frontier onwards; ids read from the runner's ``token_ids_cpu``),
        to run before its query like a longer prompt chunk (their draft KV
        is written, the drafts follow the query as usual); a head's also
        with their kept hidden states. None without free pauses or gaps. The
        runner's own inputs are the adapter's to rewrite
        (``drafters/v1_catch_up.py``)."""
        control = self.speculation
        assert control is not None
        if not control.free_pause:
            return None
        num_rows = len(batch.req_ids)
        context_lens = np.asarray(batch.context_lens_cpu, dtype=np.int64)
        query_lens = np.asarray(batch.query_lens_cpu, dtype=np.int64)
        num_tokens = int(query_lens.sum())
        budget = self.max_num_tokens - num_tokens - 2 * num_rows
        starts = control.catch_up_starts(batch.req_ids, context_lens, budget)
        if starts is None:
            return None
        layout = catch_up_layout(query_lens, starts, context_lens - starts)
        # Host-built arrays reach the device through pinned staging only (a
        # copy from pageable memory would block).
        stage = self._host_staging
        gap_positions = stage(layout.gap_positions)
        gap_hidden = None
        if self.paused_hidden is not None:
            gap_slots_of_requests = stage(control.slots(batch.req_ids)[layout.gap_rows])
            gap_hidden = self.paused_hidden.gather(gap_slots_of_requests, gap_positions)
        return CatchUp(
            layout=layout, num_rows=num_rows, num_tokens=num_tokens, order=stage(layout.order),
            gap_positions=gap_positions,
            gap_ids=stage(token_ids_cpu[layout.gap_rows, layout.gap_positions]),
            gap_rows=stage(layout.gap_rows), row_shift=stage(layout.row_shift),
            gap_hidden=gap_hidden, stage=stage)

    # ---- the runner, the worker and the benchmarks ------------------------

    @property
    def draft_lengths(self) -> PlannedDraftLengths | None:
        """Drafts each request of the last plan keeps (None: switched off)."""
        return None if self.speculation is None else self.speculation.draft_lengths

    def metrics_snapshot(self) -> dict[str, object] | None:
        return None if self.speculation is None else self.speculation.metrics_snapshot()
