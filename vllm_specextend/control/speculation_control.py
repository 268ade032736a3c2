"""Goodput control of one drafter: the one object a drafter adapter
(``drafters/``) holds for it, beside its ``DraftRetrieval`` (either may be
absent). It composes

- the :class:`~vllm_specextend.control.goodput.GoodputController`, which
  decides each request's drafts and whether the draft's forward runs;
- each request's draft KV frontier (:class:`DraftKvFrontiers`): what a
  resumed request must catch up;
- an EAGLE head's kept target hidden states (:class:`PausedHiddenStates`) and
  the pinned staging of the host-built indices.

The adapter calls it at three points:

- construction (:meth:`SpeculationControl.for_drafter`, after
  ``warm_up_control`` compiled its loops): built with what the drafter can
  catch up (a draft model from token ids, an EAGLE head also from
  the target's hidden states kept for it);
- model load (:meth:`~SpeculationControl.weigh_draft`: what a draft forward
  should cost, the warm-up's price; and
  :meth:`~SpeculationControl.allocate_paused_hidden_states`: a head's ring of
  the target's recent hidden states, before vLLM measures memory);
- every proposal: :meth:`~SpeculationControl.plan` (each request's drafts,
  and whether the draft's forward runs at all), then
  :meth:`~SpeculationControl.catch_up` (the tokens verified while the
  draft's forward was skipped, staged for the first pass; the V1 adapter
  puts them into the runner's inputs, ``drafters/v1_catch_up.py``).

A step in which nobody drafts skips the draft's forward when the drafter can
catch up. A request catches up all of its gap only when it drafts on its
acceptance estimates; a probe catches up the recent tokens its budget buys
(the plan's ``catch_up_limits``) and a paused request in a forward that runs
for others none; both keep their frontier, so drafting on estimates later
catches up the rest. Prompts too: when nobody drafts and a caught-up new
request would not draft either, a step of prompt chunks skips the draft's
forward and the request starts behind.

Control never calls back into the adapter: the adapter hands it the runner's
host state it needs (block table, token ids) as arguments. The host-side
steps (:meth:`~SpeculationControl.plan_step`,
:meth:`~SpeculationControl.catch_up_starts`) need no device: the tests and
the warm-up drive them directly.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm_specextend.common.kernel_args import ints
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.common.staging import IndexStager
from vllm_specextend.control.catch_up import CatchUp, catch_up_layout
from vllm_specextend.control.draft_lengths import (
    NO_PLANNED_DRAFT_LENGTHS,
    PlannedDraftLengths,
)
from vllm_specextend.control.frontiers import DraftKvFrontiers
from vllm_specextend.control.goodput import (
    UNLIMITED,
    DraftPlan,
    GoodputController,
    StepOutcome,
)
from vllm_specextend.control.parameters import (
    MAX_PROBE_BACKOFF,
    PROBE_INTERVAL,
    ControlParameters,
)
from vllm_specextend.control.paused_hidden_states import PausedHiddenStates
from vllm_specextend.log import plugin_logger

logger = plugin_logger(__name__)


class SpeculationControl:
    """Per engine step: how many drafts each request gets, whether the
    draft's forward runs, and what its first pass catches up. Per-request
    state is held in arrays by request slot (:class:`RequestSlots`, shared
    with retrieval)."""

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
        *,
        keeps_hidden_states: bool = False,
        max_num_tokens: int = 0,
        device: torch.device | None = None,
        steps_in_flight: int = 2,
        prices_warm_up: bool = True,
    ) -> None:
        """Host-side control without ``device``; a drafter's
        (:meth:`for_drafter`) also stages indices on its device.

        Args:
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
                what leaving them costs.
            requests: the drafter's request slots, shared with retrieval
                (None: its own).
            parameters: the controller's tuning.
            keeps_hidden_states: the drafter is fed the target's hidden
                states (an EAGLE head): a pause keeps those of the last
                ``max_catch_up + K + 1`` positions for its catch-up.
            max_num_tokens: the drafter's token budget a step.
            device: where staged indices go (None: host-side only).
            steps_in_flight: steps whose staged indices may still be read.
            prices_warm_up: the warm-up waits for its price once the draft
                is weighed (:meth:`weigh_draft`; ``goodput_warm_up``).
        """
        self.controller = GoodputController(
            max_num_reqs, num_speculative_tokens, free_pause, parameters=parameters,
            full_graph_query_len=full_graph_query_len, requests=requests,
            defer_prompts=defer_prompts)
        self.requests = self.controller.requests
        self._owns_requests = requests is None
        self.prices_warm_up = prices_warm_up
        self.kv_frontiers = DraftKvFrontiers(max_num_reqs, synced_lead, max_catch_up)
        self.requests.subscribe(left=self.kv_frontiers.forget)
        self.clock = time.perf_counter
        """Seconds now (tests simulate a device's step costs with it)."""
        self.draft_lengths = NO_PLANNED_DRAFT_LENGTHS
        """Drafts each request of the last plan keeps (the runner truncates to them)."""
        self._limits: tuple[list[str], np.ndarray] | None = None
        """The last plan's requests and catch-up limits (None: no limits)."""
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = device
        self.hidden_capacity = (max_catch_up + num_speculative_tokens + 1
                                if keeps_hidden_states else 0)
        """Positions of the target's hidden states kept per request (0: none)."""
        self.paused_hidden: PausedHiddenStates | None = None
        """An EAGLE head's recent inputs, for its catch-up (model load)."""
        # Host-built indices (kept hidden states, catch-up layout): eight
        # lists a step, each at most a step's tokens.
        self._host_staging = None if device is None else IndexStager(
            max(max_num_tokens, max_num_reqs + 1), device,
            depth=max(2, steps_in_flight), lists_per_step=8)
        """Pinned staging of host-built indices (a drafter's only)."""

    @classmethod
    def for_drafter(
        cls,
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
        prices_warm_up: bool = True,
    ) -> SpeculationControl:
        """A drafter's control (its loops compiled beforehand:
        :func:`~vllm_specextend.control.warm_up.warm_up_control`).

        Args:
            method: vLLM's speculative method.
            keeps_hidden_states: the drafter is fed the target's hidden
                states (an EAGLE head): a pause keeps them for its catch-up.
            full_graph_query_len: see :meth:`set_full_graph_query_len`
                (an engine's is known only once its attention backends are).
            requests: the drafter's request slots, shared with retrieval
                (None: its own).
            prices_warm_up: ``goodput_warm_up`` ``priced``.
        """
        is_draft_model = method == "draft_model"
        # A request paused longer is caught up from its last positions
        # (older ones stay holes); its next probe comes sooner than that.
        max_catch_up = MAX_PROBE_BACKOFF * PROBE_INTERVAL if keeps_hidden_states else None
        return cls(
            max_num_reqs, num_speculative_tokens,
            # A draft model catches up from token ids; a head also needs
            # the target's hidden states of the skipped tokens.
            free_pause=is_draft_model or keeps_hidden_states,
            # A draft model's forward also writes the sampled token's KV;
            # a head's needs the token after it.
            synced_lead=1 if is_draft_model else 0,
            max_catch_up=max_catch_up,
            # A prompt at compact positions is prefilled in chunks the
            # window allows; a head keeps only recent hidden states.
            defer_prompts=is_draft_model and not compact_positions,
            full_graph_query_len=full_graph_query_len,
            requests=requests,
            keeps_hidden_states=keeps_hidden_states,
            max_num_tokens=max_num_tokens,
            device=device,
            steps_in_flight=steps_in_flight,
            prices_warm_up=prices_warm_up,
        )

    def set_full_graph_query_len(self, full_graph_query_len: int | None) -> None:
        """The query length of every request in a decode step that replays the
        target's FULL CUDA graphs (``1 + K``; None: none), read once vLLM has
        settled its graph mode: its runner may change it when it sets up the
        attention backends, after the drafter is built."""
        self.controller.set_full_graph_query_len(full_graph_query_len)

    def limit_outputs(self, slots: np.ndarray, max_tokens: list[int | None]) -> None:
        """The most tokens each request in ``slots`` may generate (its
        sampling ``max_tokens``; None: no limit), told when it arrives: a
        request never drafts past them, so its last step drafts nothing (no
        draft forward where every request ends) and no probe falls on it."""
        self.controller.state.max_output_tokens[slots] = [
            UNLIMITED if limit is None else limit for limit in max_tokens]

    def weigh_draft(self, draft: torch.nn.Module, target: torch.nn.Module) -> None:
        """At model load, for a priced warm-up (``goodput_warm_up``): a draft
        forward is expected to cost its parameters' share of the target's
        step (a decode step reads every weight), the warm-up's price until a
        draft is timed (``DraftWarmUp.draft_forward_share``)."""
        if not self.prices_warm_up:
            return
        share = parameter_count(draft) / parameter_count(target)
        self.controller.warm_up.draft_forward_share = share
        logger.info("SpecExtend: goodput control prices its warm-up with a draft forward at "
                    "%.3f of a target step (the draft's parameters over the target's)", share)

    def allocate_paused_hidden_states(self, width: int, dtype: torch.dtype) -> None:
        """At model load, for a drafter fed the target's hidden states (an
        EAGLE head): keep the recent ones, so that a pause skips the head's
        forward too and a later forward catches up."""
        assert self.hidden_capacity and self._host_staging is not None, (
            "built for a drafter that keeps no hidden states")
        self.paused_hidden = PausedHiddenStates(
            self.max_num_reqs, self.hidden_capacity, width, dtype, self.device)
        logger.info(
            "SpecExtend: goodput control keeps the target's hidden states of the last %d "
            "positions per request for the head (%.1f MiB)", self.hidden_capacity,
            self.paused_hidden.states.numel() * self.paused_hidden.states.element_size() / 2**20)

    # ---- per step: the drafter's ------------------------------------------

    def plan(self, batch: PlanningBatch, block_table: np.ndarray, block_size: int,
             target_hidden_states: torch.Tensor | None) -> int | None:
        """This step's plan: the most drafts a request keeps, or None when
        nobody drafts (no forward, no retrieval: caught up later).
        ``block_table``: the runner's host block table of the step's rows."""
        plan = self.plan_step(batch.req_ids, batch.context_lens_cpu, batch.query_lens_cpu,
                              batch.prompt_lens_cpu, block_table, block_size)
        self._host_staging.next_step()
        # Kept every step: a request may catch up later what a forward that
        # ran left behind it (paused, or probing a part of its gap).
        if self.paused_hidden is not None:
            token_slots = np.repeat(self.requests.slots(batch.req_ids), batch.query_lens_cpu)
            self.paused_hidden.record(self._host_staging(token_slots), batch.positions,
                                      target_hidden_states)
        return plan.draft_steps if plan.runs_draft_forward else None

    def catch_up(self, batch: PlanningBatch, token_ids_cpu: np.ndarray) -> CatchUp | None:
        """What this step's first pass catches up, staged on the device: per
        row, the tokens verified while the draft's forward was skipped (its
        KV frontier onwards; ids read from the runner's ``token_ids_cpu``),
        to run before its query like a longer prompt chunk (their draft KV
        is written, the drafts follow the query as usual); a head's also
        with their kept hidden states. None without free pauses or gaps. The
        runner's own inputs are the adapter's to rewrite
        (``drafters/v1_catch_up.py``)."""
        if not self.controller.free_pause:
            return None
        num_rows = len(batch.req_ids)
        context_lens = np.asarray(batch.context_lens_cpu, dtype=np.int64)
        query_lens = np.asarray(batch.query_lens_cpu, dtype=np.int64)
        num_tokens = int(query_lens.sum())
        budget = self.max_num_tokens - num_tokens - 2 * num_rows
        starts = self.catch_up_starts(batch.req_ids, context_lens, budget)
        if starts is None:
            return None
        layout = catch_up_layout(query_lens, starts, context_lens - starts)
        # Host-built arrays reach the device through pinned staging only (a
        # copy from pageable memory would block).
        stage = self._host_staging
        gap_positions = stage(layout.gap_positions)
        gap_hidden = None
        if self.paused_hidden is not None:
            gap_slots_of_requests = stage(self.requests.slots(batch.req_ids)[layout.gap_rows])
            gap_hidden = self.paused_hidden.gather(gap_slots_of_requests, gap_positions)
        return CatchUp(
            layout=layout, num_rows=num_rows, num_tokens=num_tokens, order=stage(layout.order),
            gap_positions=gap_positions,
            gap_ids=stage(token_ids_cpu[layout.gap_rows, layout.gap_positions]),
            gap_rows=stage(layout.gap_rows), row_shift=stage(layout.row_shift),
            gap_hidden=gap_hidden, stage=stage)

    # ---- per step: on the host --------------------------------------------

    def plan_step(
        self,
        req_ids: list[str],
        context_lens: np.ndarray,
        query_lens: np.ndarray,
        prompt_lens: np.ndarray,
        block_table: np.ndarray | None = None,
        block_size: int = 0,
    ) -> DraftPlan:
        """This step's plan (``plan.runs_draft_forward``: whether the
        draft's forward runs; ``block_table``: the rows' KV block ids on the
        host, to keep prefix cache hits on blocks without the draft's KV
        right; None: not kept)."""
        now = self.clock()
        frontiers = self.kv_frontiers
        frontiers.keep_block_table(block_table, block_size)
        slots = self.requests.of_step(req_ids, self._owns_requests)
        context_lens, query_lens = ints(context_lens), ints(query_lens)
        starts, gaps, whole, _ = frontiers.advance(slots, context_lens, ints(prompt_lens))
        plan = self.controller.plan(req_ids, context_lens, query_lens, prompt_lens, now,
                                    catch_up_gaps=gaps, whole_catch_up=whole)
        planned = list(req_ids)
        self.draft_lengths = PlannedDraftLengths(planned, plan.draft_lengths)
        self._limits = None if plan.catch_up_limits is None else (planned, plan.catch_up_limits)
        if plan.deferred_rows is not None:
            # A caught-up request would not draft now: its prompt waits.
            frontiers.defer(slots[plan.deferred_rows])
        frontiers.end_step(slots, plan.runs_draft_forward, starts, context_lens, query_lens,
                           plan.catch_up_limits, gaps)
        self.controller.forced_account.spent_on_host(self.clock() - now)
        return plan

    def catch_up_starts(self, req_ids: list[str], context_lens: np.ndarray,
                        budget: int) -> np.ndarray | None:
        """Per row, the first position this step's first pass processes (None:
        nothing is caught up): from its draft KV frontier, or its most recent
        tokens within the plan's limit and, for all rows together, ``budget``
        tokens (beyond it, and beyond a head's kept positions, holes stay
        holes). Rows left short keep their frontier (they are no longer
        synced), the holes turn stale at the next plan, and the controller
        learns the tokens' cost."""
        slots = self.requests.slots(req_ids)
        limits = None
        if self._limits is not None:
            plan_ids, limits = self._limits
            if req_ids != plan_ids:
                limit_of = dict(zip(plan_ids, limits.tolist()))
                limits = np.array([limit_of[r] for r in req_ids], dtype=np.int64)
        starts, tokens = self.kv_frontiers.catch_up(slots, ints(context_lens), limits, budget)
        if tokens < 0:
            return None
        self.controller.observe(StepOutcome(catch_up_tokens=tokens))
        return starts

    def frontiers(self, req_ids: list[str]) -> np.ndarray:
        """Per row, its draft KV frontier (every position before it is right)."""
        return self.kv_frontiers.of(self.requests.slots(req_ids))

    # ---- the runner, the worker and the benchmarks ------------------------

    def metrics_snapshot(self) -> dict[str, object]:
        stats, state = self.controller.stats, self.controller.state
        return {
            "drafted_request_steps": stats.drafted_request_steps,
            "paused_request_steps": stats.paused_request_steps,
            "probes": stats.probes,
            "forced_draft_seconds": self.controller.forced_account.excess_seconds,
            "forced_priced_seconds": self.controller.forced_account.priced_seconds,
            "host_seconds": self.controller.forced_account.host_seconds,
            "warm_up_pending": int(self.controller.warm_up.pending),
            "explorations": stats.explorations,
            "skipped_draft_forwards": stats.skipped_draft_forwards,
            "catch_up_tokens": stats.catch_up_tokens,
            "deferred_prefill_tokens": stats.deferred_prefill_tokens,
            "chosen_draft_lengths": stats.chosen_lengths.tolist(),
            "request_paused_fraction": stats.request_paused_fraction.as_dict(),
            # Per live request: decode steps drafted and paused.
            "requests": {req_id: {"drafted_steps": int(state.drafted_steps[slot]),
                                  "paused_steps": int(state.paused_decode_steps[slot])}
                         for req_id, slot in self.requests.items()},
        }


def parameter_count(module: torch.nn.Module) -> int:
    """Elements of ``module``'s parameters, each tensor once (tied embeddings).
    A vLLM linear layer whose weight the CPU build packed away (its GEMM
    dispatch leaves an empty ``weight``) counts by its sizes: counted as
    empty, the Qwen pair's draft weighed 0.58 of the target, not 0.35."""
    tensors = {p.data_ptr(): p.numel() for p in module.parameters() if p.numel()}
    packed = sum(_linear_weight_elements(layer) for layer in module.modules()
                 if isinstance(getattr(layer, "weight", None), torch.Tensor)
                 and layer.weight.numel() == 0 and hasattr(layer, "output_size"))
    return sum(tensors.values()) + packed


def _linear_weight_elements(layer: torch.nn.Module) -> int:
    """A vLLM ``LinearBase``'s weight elements on this rank (a parallel
    layer's partition; a replicated one's whole)."""
    return (getattr(layer, "input_size_per_partition", layer.input_size)
            * getattr(layer, "output_size_per_partition", layer.output_size))
