"""Goodput control's decisions, all in this module: per step and per
request, how many tokens to draft (0: the request pauses), and whether the
draft's forward runs at all.

Goodput is accepted tokens per second of the whole batch. From

- a step-cost model learnt online on this engine (:class:`StepCostModel`):
  seconds between two drafter calls, a linear function of what the step
  verifies, drafts and catches up;
- per-request acceptance estimates (:class:`AcceptanceEstimates`): an EWMA of
  each draft position's acceptance, from the verifications seen so far,

a request pauses (drafts nothing) in a step unless one of these says it drafts:

1. **Estimates** (:func:`choose_draft_lengths`, compiled in
   ``choice_kernel.py``): a fractional programme solved by Dinkelbach's
   iteration for each number of draft steps ``D``; a request keeps draft
   position ``i`` when the probability that it is accepted is worth more
   than the position's verification time at the batch's goodput, with
   ``hysteresis`` (a paused row's catch-up priced), and a drafting plan
   must beat pausing everyone by ``pause_margin``.
2. **Probes** (``plan_kernels.forced_rows``): a paused request drafts once
   when its back-off is up (``probe_interval`` paused plans, doubling after
   each failed probe, to at most ``max_probe_backoff`` x ``probe_interval``)
   and its budget
   (``probe_budget`` of the time it paused) covers a draft and its least
   catch-up at their predicted price; the engine pays what they measured
   (:class:`ForcedDraftAccount`): while it is in debt no row drafts by force.
3. **Warm-up and exploration**: the engine's first plans with decoding rows
   (:class:`DraftWarmUp`; priced, it waits until the account covers it),
   then every ``explore_interval`` plans one that departs from the choice
   (:meth:`GoodputController._explore`), so the cost model keeps seeing
   every number of draft steps; a row not drafting on its estimates joins
   only within its budget.

The draft's forward then runs unless nobody drafts and the drafter can catch
up later (``free_pause``, :func:`decide_draft_forward`). A step with prompt
chunks runs it anyway where the drafter cannot ``defer_prompts``, where a
caught-up new request would draft beside this batch, or where the prompts'
draft prefill fits the prompt budget (``probe_budget`` of the steps nobody
drafted in): ``DraftPlan.draft_prefill``.

On the host (numpy, and loops compiled with numba for the per-row
arithmetic): the inputs are per-request lengths the host already knows, so a
decision adds no device sync. Everything here is independent of vLLM; its
tuning is one record, :class:`ControlParameters`.
"""

from __future__ import annotations

import numpy as np

from vllm_specextend.common.kernel_args import flags, floats, ints
from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.control.acceptance import AcceptanceEstimates
from vllm_specextend.control.control_stats import FOLD_AT, ControlStats
from vllm_specextend.control.cost_model import StepCostModel, step_features
from vllm_specextend.control.draft_lengths import DraftPlan, choose_draft_lengths
from vllm_specextend.control.draft_warm_up import DraftWarmUp
from vllm_specextend.control.forced_account import ForcedDraftAccount
from vllm_specextend.control.kernel_state import (
    ChoiceSettings,
    PlanSettings,
    PlanShape,
    RequestState,
    RowScratch,
    StepCosts,
    StepRows,
)
from vllm_specextend.control.parameters import (
    MAX_PROBE_BACKOFF,
    PROBE_INTERVAL,
    ControlParameters,
    StepOutcome,
)
from vllm_specextend.control.plan_kernels import (
    UNLIMITED,
    affordable,
    paused_fractions,
    plan_rows,
    settle_plan,
    start_requests,
    step_rows,
)
from vllm_specextend.log import plugin_logger

logger = plugin_logger(__name__)

__all__ = [
    "MAX_PROBE_BACKOFF", "PROBE_INTERVAL", "UNLIMITED", "AcceptanceEstimates",
    "ControlParameters", "DraftPlan", "GoodputController", "StepCostModel", "StepOutcome",
    "choose_draft_lengths", "decide_draft_forward", "step_features",
]

_NO_INTS = np.zeros(0, dtype=np.int64)
_NO_FLAGS = np.zeros(0, dtype=bool)


class GoodputController:
    """Per step, the draft lengths of the next verification for every request
    of the batch, and whether the draft's forward runs (see the module).

    Per step: :meth:`plan` once, at the drafter's call, with the host-side
    lengths of the batch (it first learns from the step those lengths
    show), and :meth:`observe` with what only the engine knows after it
    (the tokens its first pass caught up). Per-request state is held in
    arrays by slot (:class:`RequestSlots`); requests that leave the batch
    leave their slots (:meth:`finish`, when the slots are the controller's
    own). What forced drafts (probes, warm-up, exploration) may cost:
    ``plan_kernels.forced_rows``.
    """

    def __init__(
        self,
        max_num_reqs: int,
        num_speculative_tokens: int,
        free_pause: bool,
        parameters: ControlParameters = ControlParameters(),
        full_graph_query_len: int | None = None,
        requests: RequestSlots | None = None,
        defer_prompts: bool = False,
    ) -> None:
        """``free_pause``: a step where nobody drafts skips the draft's
        forward (the drafter catches up later).
        ``full_graph_query_len``: the query length of every request in a
        decode step that runs in the target's FULL CUDA graphs (``1 + K``
        under vLLM's FULL decode graphs); None: no FULL graphs (until
        :meth:`set_full_graph_query_len`).
        ``requests``: the drafter's request slots, shared with its other
        feature (None: its own).
        ``defer_prompts``: with ``free_pause``, a step of prompt chunks may
        skip the draft's forward too (a drafter that can catch up a whole
        prompt). (Long for the docstrings of its fields: it only assigns.)"""
        self.num_speculative_tokens = num_speculative_tokens
        self.full_graph_query_len = full_graph_query_len
        self.free_pause = free_pause
        self.defer_prompts = defer_prompts and free_pause
        self.parameters = p = parameters
        self.cost = self._cost_model()
        self.acceptance = AcceptanceEstimates(max_num_reqs, num_speculative_tokens,
                                              smoothing=p.acceptance_smoothing,
                                              prior=p.acceptance_prior,
                                              probe_smoothing=p.probe_smoothing)
        self.stats = ControlStats(chosen_lengths=np.zeros(num_speculative_tokens + 1, np.int64))
        self.requests = RequestSlots.shared_or_new(requests, max_num_reqs)
        self._owns_requests = requests is None
        self.requests.subscribe(arrived=self._admit, left=self._finish)
        self.state = RequestState.new(max_num_reqs)
        """Each request's state between steps, by slot (``RequestState``)."""
        self._scratch = RowScratch.new(max_num_reqs)
        """Per row of a plan (its first rows): what the loops work out."""
        self._settings = PlanSettings(
            float(p.probe_budget), int(p.min_probe_catch_up), int(p.probe_interval),
            int(p.max_probe_backoff),
            ChoiceSettings(float(p.hysteresis), float(p.pause_margin), bool(free_pause)),
            int(p.catch_up_growth))
        self.forced_account = ForcedDraftAccount(p.probe_budget, p.probe_interval)
        self._arrival_probe_after = 0
        """Probe back-off of a new request: the latest probe's, until a
        request drafts on its estimates again (short requests would
        otherwise each pay the probes that already failed for others)."""
        self._last_time: float | None = None
        self._last_prefilling = True
        self._last_draft_forwards = 0
        self._last_catch_up_tokens = 0
        self.warm_up = DraftWarmUp(num_speculative_tokens, p.min_probe_catch_up)
        self._since_exploration = 0
        self._prompt_budget = 0.0
        """Seconds of draft prefill the engine may spend on prompts it would
        defer: ``probe_budget`` of every step nobody drafts in. A prompt let
        through keeps its request able to probe, so an engine whose requests
        all arrive paused still learns when drafting pays again."""

    def _cost_model(self) -> StepCostModel:
        p = self.parameters
        return StepCostModel(self.num_speculative_tokens, forgetting=p.cost_forgetting,
                             ridge=p.cost_ridge,
                             piecewise_step=self.full_graph_query_len is not None)

    def set_full_graph_query_len(self, full_graph_query_len: int | None) -> None:
        """The target's FULL decode graphs as vLLM settled them, once its
        runner knew the attention backends (it may turn FULL into
        FULL_DECODE_ONLY, or drop FULL graphs): call before the first step.
        A change starts the step-cost model over (``piecewise_step``)."""
        if full_graph_query_len != self.full_graph_query_len:
            self.full_graph_query_len = full_graph_query_len
            self.cost = self._cost_model()

    # ---- per step --------------------------------------------------------

    def _admit(self, req_ids: list[str], new: np.ndarray) -> None:
        """New requests start from the engine's acceptance estimates and the
        latest probe back-off."""
        start_requests(new, self._arrival_probe_after, self.state,
                       self.acceptance.kernel_args())

    def observe(self, outcome: StepOutcome) -> None:
        """What the engine did with the last plan beyond what the plan
        decided (its cost is learnt at the next plan, from the clock)."""
        if outcome.draft_forwards is not None:
            self._last_draft_forwards = outcome.draft_forwards
        self._last_catch_up_tokens += outcome.catch_up_tokens
        self.stats.catch_up_tokens += outcome.catch_up_tokens

    def plan(
        self,
        req_ids: list[str],
        context_lens: np.ndarray,
        query_lens: np.ndarray,
        prompt_lens: np.ndarray,
        now: float,
        catch_up_gaps: np.ndarray | None = None,
        whole_catch_up: np.ndarray | None = None,
    ) -> DraftPlan:
        """The plan for the next verification of ``req_ids`` (this step's
        batch: ``context_lens`` computed tokens before this step's
        ``query_lens``; ``catch_up_gaps``: tokens each request's draft KV is
        behind; ``whole_catch_up``: requests whose forced drafts must catch
        up all of their gap, as one whose prompt the draft lacks: with holes
        there a probe would not measure the draft): each request's drafts
        (:meth:`choose`), then whether the draft's forward runs."""
        plan = self.choose(req_ids, context_lens, query_lens, prompt_lens, now,
                           catch_up_gaps=catch_up_gaps, whole_catch_up=whole_catch_up)
        self._decide_forward(plan, ints(context_lens) >= ints(prompt_lens), ints(query_lens))
        return plan

    def choose(
        self,
        req_ids: list[str],
        context_lens: np.ndarray,
        query_lens: np.ndarray,
        prompt_lens: np.ndarray,
        now: float,
        catch_up_gaps: np.ndarray | None = None,
        whole_catch_up: np.ndarray | None = None,
    ) -> DraftPlan:
        """Each request's drafts (arguments: :meth:`plan`'s), observing the
        step just verified first: on estimates, probes, warm-up and
        exploration, and whether prompt chunks go through the draft. (Long
        as one step's sequence in order, each part a compiled call or a
        method.)"""
        p = self.parameters
        slots = self.requests.of_step(req_ids, self._owns_requests)
        num_requests = len(req_ids)
        graph = self.full_graph_query_len
        step = StepRows(
            slots, ints(context_lens), ints(query_lens), ints(prompt_lens),
            _NO_INTS if catch_up_gaps is None else ints(catch_up_gaps),
            _NO_FLAGS if whole_catch_up is None or catch_up_gaps is None
            else flags(whole_catch_up))
        estimates = self.acceptance.kernel_args()
        scratch = self._scratch
        # Rows still prefilling after this step get no drafts (vLLM drops them).
        tokens, other_tokens, prefilling, uniform = step_rows(
            step, -1 if graph is None else graph, self.state, estimates, scratch)
        decode_step = not (prefilling or self._last_prefilling) and self._last_time is not None
        self._learn(tokens, graph is not None and not uniform,
                    now - self._last_time if decode_step else None)
        self._last_time, self._last_prefilling = now, prefilling
        self._last_catch_up_tokens = 0
        exploring = self._exploration_due()
        survival = estimates.survival[:num_requests]
        lengths, steps, goodput, paused_step, some_decode, limits, counts = plan_rows(
            step, self.state, scratch, estimates, self._costs(),
            self.forced_account.settings(self._settings),
            PlanShape(other_tokens, -1 if graph is None else graph - 1, not exploring),
            self.stats.chosen_lengths)
        plan = DraftPlan(lengths, steps, goodput)
        warm_up = self.warm_up.pending and scratch.decoding[:num_requests].any()
        if warm_up:
            plan = self.warm_up.plan(plan, scratch.decoding[:num_requests],
                                     scratch.least_catch_up[:num_requests], paused_step,
                                     self.forced_account)
            if self.warm_up.priced:  # its rows draft by force: catch up what a probe would
                lengths = np.zeros_like(lengths)
        elif exploring:
            plan = self._explore(plan, scratch.decoding[:num_requests],
                                 scratch.budget[:num_requests],
                                 scratch.least_catch_up[:num_requests])
        elif some_decode:
            self._since_exploration += 1  # what _explore counts when it changes nothing
        if plan.draft_steps == 0:
            self._prompt_budget += p.probe_budget * paused_step
            if prefilling:
                verifying = scratch.verifying[:num_requests]
                drafting = scratch.drafting[:num_requests]
                resume = None if catch_up_gaps is None else scratch.resume[:num_requests]
                plan.draft_prefill = self._prompt_through_draft(
                    survival, drafting, resume, ~verifying, step.query_lens, num_requests)
        if exploring:
            limits, counts = self._settle(slots, plan.draft_lengths, lengths)
        self.forced_account.planned(
            paused_step, counts[4], plan.draft_lengths, lengths, scratch.probing[:num_requests],
            self.warm_up.priced if warm_up and self.warm_up.planned_now else None)
        if warm_up and self.warm_up.planned_now and not self.warm_up.drafts_left:
            self.forced_account.release()  # the price it waited for is spent
        return self._noted(plan, limits, counts)

    def _learn(self, tokens: int, piecewise: bool, seconds: float | None) -> None:
        """The last step's ``seconds`` (None: a prefill's) learnt, and charged if forced."""
        priced = None
        if seconds is not None:
            p, cost = self.parameters, self.cost
            features = cost.features(tokens, self._last_draft_forwards,
                                     self._last_catch_up_tokens, piecewise)
            if self.forced_account.measuring:
                priced = float(cost.predict(features))
                logger.debug("Forced step: %.3f s, priced %.3f s (features %s, weights %s)",
                             seconds, priced, features.tolist(), cost.weights.tolist())
            cost.observe_step(features, seconds, p.stall_factor, p.slow_step_clip)
        self.forced_account.measured(seconds, priced)

    def _decide_forward(self, plan: DraftPlan, verifying: np.ndarray,
                        query_lens: np.ndarray) -> None:
        """:func:`decide_draft_forward`, counted; the forwards it runs are
        the next step's cost."""
        decide_draft_forward(plan, verifying, self.free_pause, self.defer_prompts)
        if plan.deferred_rows is not None:
            self.stats.deferred_prefill_tokens += int(query_lens[plan.deferred_rows].sum())
        runs = plan.runs_draft_forward
        self._last_draft_forwards = max(plan.draft_steps, 1) if runs else 0
        self.stats.skipped_draft_forwards += not runs

    def _exploration_due(self) -> bool:
        """Whether this plan may depart from the choice: a warm-up plan, or
        an exploration's interval is up (otherwise it only counts the plan)."""
        return (self.warm_up.pending
                or self._since_exploration + 1 >= self.parameters.explore_interval)

    def _settle(self, slots: np.ndarray, lengths: np.ndarray, chosen: np.ndarray) -> tuple:
        """A plan's catch-up limits and each request's state after it
        (:func:`~vllm_specextend.control.plan_kernels.settle_plan`; in
        :func:`~vllm_specextend.control.plan_kernels.plan_rows` when no
        exploration changes the plan).

        Catch-up limits: a row drafting on its estimates catches up all of
        its gap, a paused row none, a row drafting by force (probing, none
        chosen: warm-up, exploration) what its budget buys beyond its
        drafts, and at least its least catch-up (only that until a catch-up
        was timed)."""
        return settle_plan(slots, ints(lengths), ints(chosen), self._scratch, self._costs(),
                           self.state, self.stats.chosen_lengths, self._settings)

    def _costs(self) -> StepCosts:
        """The step-cost model as the loops price a step with."""
        return self.cost.kernel_args()

    def _noted(self, plan: DraftPlan, limits: np.ndarray, counts: tuple) -> DraftPlan:
        """The plan with its catch-up limits; the engine's counts."""
        probes, arrival, changed, drafted, paused = counts
        if changed:
            # Requests arriving after a failed probe wait as long.
            self._arrival_probe_after = arrival
        self.stats.probes += probes
        self.stats.drafted_request_steps += drafted
        self.stats.paused_request_steps += paused
        plan.catch_up_limits = limits
        return plan

    def finish(self, req_ids: list[str]) -> None:
        """Requests that left the batch (finished or aborted): their slots
        are freed (:meth:`_finish`)."""
        self.requests.release(req_ids)

    def _finish(self, req_ids: list[str], freed: np.ndarray) -> None:
        """Keep the paused share of requests that left, for the metrics."""
        stats = self.stats
        stats.finished_paused_fractions += paused_fractions(freed, self.state).tolist()
        if len(stats.finished_paused_fractions) > FOLD_AT:
            stats.fold()

    # ---- internals -------------------------------------------------------

    def _prompt_through_draft(self, survival, drafting, resume, prompting: np.ndarray,
                              query_lens: np.ndarray, num_requests: int) -> bool:
        """Whether this step's prompt chunks go through the draft when nobody
        drafts: before the warm-up (it needs a request in sync), where a new
        request would draft, or within the prompt budget."""
        if self.warm_up.pending or self._new_request_drafts(survival, drafting, resume,
                                                            prompting, num_requests):
            return True
        cost = self.cost.catch_up_seconds() * int(query_lens[prompting].sum())
        if cost > self._prompt_budget:
            return False
        self._prompt_budget -= cost
        return True

    def _new_request_drafts(self, survival: np.ndarray, drafting: np.ndarray,
                            resume: np.ndarray | None, prompting: np.ndarray,
                            num_requests: int) -> bool:
        """Whether a request with prompt tokens in this step (``prompting``)
        would draft at its decode steps beside this batch, caught up and as
        likely to be accepted as the engine's requests so far. Only numbers
        of draft steps the engine has timed count, once it has timed one: an
        untimed one is only priced by proportion to a timed one, which is
        no reason to pay a prompt's draft prefill."""
        fresh = np.cumprod(self.acceptance.engine_rates)
        seen = self.cost.draft_steps_seen()
        plan = choose_draft_lengths(
            np.where(prompting[:, None], fresh[None, :], survival), drafting & ~prompting,
            self.cost, num_requests, free_pause=self.free_pause,
            hysteresis=self.parameters.hysteresis, pause_margin=self.parameters.pause_margin,
            resume_seconds=None if resume is None else np.where(prompting, 0.0, resume),
            draft_steps=seen if seen[1:].any() else None)
        return bool(plan.draft_lengths[prompting].any())

    def _explore(self, plan: DraftPlan, decoding: np.ndarray, budgets: np.ndarray,
                 least: np.ndarray) -> DraftPlan:
        """Every ``explore_interval`` plans after the warm-up, one that
        departs from the choice: every row drafting D (D cycling through
        1..K) or, while some rows draft, every other time none. The cost
        model then keeps seeing every number of draft steps. A row not
        drafting on its estimates joins an exploring draft only when its
        probe budget covers it (the exploration waits for one that does)."""
        if not decoding.any():
            return plan
        self._since_exploration += 1
        if self._since_exploration < self.parameters.explore_interval:
            return plan
        if plan.draft_steps > 0 and self.stats.explorations % 2 == 0:
            plan = DraftPlan(np.zeros_like(plan.draft_lengths), 0, plan.expected_goodput)
        else:
            steps = 1 + (self.stats.explorations // 2) % self.num_speculative_tokens
            drafting = plan.draft_lengths > 0
            # Rows not drafting anyway join where their budgets cover it
            # (their share of the forward split with those that join).
            rows = decoding & (drafting | affordable(
                budgets, least, floats(self.cost.weights), steps, flags(drafting),
                flags(decoding), self.cost.forced_catch_up_seconds()))
            if not rows.any():
                return plan  # until a budget covers it
            plan = DraftPlan(np.where(rows, steps, 0), steps, plan.expected_goodput)
        self.stats.explorations += 1
        self._since_exploration = 0
        return plan


def decide_draft_forward(plan: DraftPlan, verifying: np.ndarray, free_pause: bool,
                         defer_prompts: bool) -> None:
    """Whether ``plan``'s draft forward runs (``plan.runs_draft_forward``):
    unless nobody drafts and the drafter can catch up later (``free_pause``);
    with rows in their prompt (not ``verifying``), unless the drafter may
    ``defer_prompts`` and the plan keeps them from the draft
    (``draft_prefill``). Rows whose prompt chunks then skip the draft:
    ``plan.deferred_rows``."""
    prefilling = not verifying.all()
    runs = not (free_pause and plan.draft_steps == 0 and not (
        prefilling and (plan.draft_prefill or not defer_prompts)))
    plan.runs_draft_forward = runs
    plan.deferred_rows = ~verifying if prefilling and not runs else None
