"""Per-request speculation lengths that maximise expected goodput.

Goodput is accepted tokens per second of the whole batch. For the next
verification step every request gets its own number of drafts ``K_r`` in
``0..K``, from

- a step-cost model learnt online on this engine (:class:`StepCostModel`):
  seconds between two drafter calls, a linear function of what the step
  verifies and drafts, fitted by exponentially weighted ridge regression;
- per-request acceptance estimates (:class:`AcceptanceEstimates`): an EWMA of
  each draft position's acceptance, from the verifications seen so far.

The choice (:func:`choose_draft_lengths`) is a fractional programme solved by
Dinkelbach's iteration for each possible number of draft steps ``D``: a
request keeps draft position ``i`` when the probability that it is accepted
(the product of the positions' rates up to ``i``) is worth more than the
position's verification time at the batch's goodput. Hysteresis keeps rows from
flapping and paused rows are probed periodically, so a request resumes when
drafting would pay again.

Pure numpy on the host: the inputs are per-request lengths the host already
knows, so a decision adds no device sync. Everything here is independent of
vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from vllm_specextend.core.counters import DeviceHistogram
from vllm_specextend.core.request_slots import RequestSlots

PAUSED_FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def cost_features(max_draft_steps: int, piecewise_step: bool = False) -> tuple[str, ...]:
    """What one engine step costs, linearly: a base (the batch's target
    forward, which grows with its context and requests; the exponential
    forgetting tracks it), each token verified beyond it, each token the
    draft catches up after a pause, and the draft phase as one cost per
    number of draft steps ``D`` (one-hot). A table rather
    than a cost per forward: on CPUs the target's step is not linear in its
    tokens at small batch (measured on the Qwen pair, bf16: verifying 2
    tokens cost 0.154 s, 3 tokens 0.113 s, 1 token 0.121 s), and at batch 1
    the tokens and ``D`` move together, so only a cost per ``D`` can tell
    which ``D`` pays.

    With ``piecewise_step`` (the target runs FULL CUDA graphs): one more, a
    step whose target forward left them. Under vLLM's FULL decode graphs a
    batch is a graph's only when every request verifies ``1 + K`` tokens
    (``GPUModelRunner._is_uniform_decode``); a step with fewer drafts for
    some request, or none, runs PIECEWISE."""
    return ("step", "verified_tokens", "catch_up_tokens") + tuple(
        f"draft_steps_{d}" for d in range(1, max_draft_steps + 1)) + (
        ("piecewise_step",) if piecewise_step else ())


NUM_LINEAR_FEATURES = 3
"""The features before the one-hot draft steps (clipped at zero when fitted)."""


def step_features(verified_tokens: int, draft_steps: int, max_draft_steps: int,
                  catch_up_tokens: int = 0, piecewise: bool | None = None) -> np.ndarray:
    """The cost features of one step (see :func:`cost_features`); ``piecewise``
    only for a model with the ``piecewise_step`` feature (None: without)."""
    features = np.zeros(NUM_LINEAR_FEATURES + max_draft_steps + (piecewise is not None),
                        dtype=np.float64)
    features[:NUM_LINEAR_FEATURES] = 1.0, verified_tokens, catch_up_tokens
    if draft_steps:
        features[NUM_LINEAR_FEATURES - 1 + min(draft_steps, max_draft_steps)] = 1.0
    if piecewise is not None:
        features[-1] = float(piecewise)
    return features


class StepCostModel:
    """Seconds per engine step, ``features . weights``, learnt online.

    Exponentially weighted ridge regression (recent steps count more; the
    ridge term keeps unidentified weights at zero until the data tells them
    apart: a number of draft steps never seen costs nothing beyond its
    tokens, so the controller tries it when acceptance says it would pay, and
    learns). The base and the per-token costs are clipped at zero; the cost of
    ``D`` draft steps is not, since it corrects the per-token cost at small
    batch, where the two move together (a 3-token step can cost less than a
    2-token one).
    """

    def __init__(self, max_draft_steps: int, forgetting: float = 0.98,
                 ridge: float = 1e-6, piecewise_step: bool = False) -> None:
        self.max_draft_steps = max_draft_steps
        self.piecewise_step = piecewise_step
        """Whether steps that leave FULL CUDA graphs carry a cost of their own."""
        num = len(cost_features(max_draft_steps, piecewise_step))
        self.forgetting = forgetting
        self.ridge = ridge
        self._gram = np.zeros((num, num))
        self._moment = np.zeros(num)
        self.weights = np.zeros(num)
        self.observations = 0
        self.seen = np.zeros(num, dtype=bool)
        """Features some observed step had."""

    def observe(self, features: np.ndarray, seconds: float) -> None:
        self._gram = self.forgetting * self._gram + np.outer(features, features)
        self._moment = self.forgetting * self._moment + features * seconds
        self.observations += 1
        self.seen |= features != 0
        # Scale the ridge with the data so it stays a tie-breaker. It pulls
        # towards the current weights: a cost the recent steps no longer show
        # (a number of draft steps not run for hundreds of paused steps) keeps
        # what was learnt, instead of decaying to free.
        ridge = self.ridge * max(float(np.trace(self._gram)), 1.0)
        regularised = self._gram + ridge * np.eye(len(features))
        weights = np.linalg.solve(regularised, self._moment + ridge * self.weights)
        weights[:NUM_LINEAR_FEATURES] = np.maximum(weights[:NUM_LINEAR_FEATURES], 0.0)
        if self.piecewise_step:
            weights[-1] = max(weights[-1], 0.0)
        self.weights = weights

    def knows(self, features: np.ndarray) -> bool:
        """Whether recent steps showed every feature ``features`` has (about
        one step's weight at least since forgetting)."""
        return bool((np.diag(self._gram)[features != 0] >= 1.0).all())

    def predict(self, features: np.ndarray) -> np.ndarray | float:
        return features @ self.weights

    def draft_steps_seen(self) -> np.ndarray:
        """``[K + 1]`` bool: the numbers of draft steps some observed step
        ran (0: always)."""
        return np.concatenate(([True], self.seen[NUM_LINEAR_FEATURES:][:self.max_draft_steps]))

    @property
    def piecewise_cost(self) -> float:
        """Seconds a step pays for leaving the FULL CUDA graphs (0 without them)."""
        return float(self.weights[-1]) if self.piecewise_step else 0.0

    def features(self, verified_tokens: int, draft_steps: int, catch_up_tokens: int = 0,
                 piecewise: bool = False) -> np.ndarray:
        """:func:`step_features` in this model's layout."""
        return step_features(verified_tokens, draft_steps, self.max_draft_steps,
                             catch_up_tokens, piecewise if self.piecewise_step else None)


PROBE_SMOOTHING = 0.5
"""EWMA weight of a probe's outcome (a drafting request's outcomes weigh
``AcceptanceEstimates.smoothing``)."""


class AcceptanceEstimates:
    """Per request slot and draft position: the EWMA of "accepted, given every
    earlier position was". New requests start from the engine-wide estimate."""

    def __init__(self, max_requests: int, num_positions: int, smoothing: float = 0.2,
                 prior: float = 0.7, probe_smoothing: float = PROBE_SMOOTHING) -> None:
        self.smoothing = smoothing
        self.probe_smoothing = probe_smoothing
        self.engine_rates = np.full(num_positions, prior)
        self.rates = np.full((max_requests, num_positions), prior)

    def start(self, slot: int) -> None:
        self.rates[slot] = self.engine_rates

    def observe(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
                probed: np.ndarray | None = None) -> None:
        """Verification outcomes: row ``r`` (slot ``slots[r]``) had
        ``drafted[r]`` drafts, the first ``accepted[r]`` accepted. Position
        ``i`` (0-based) was tried iff ``i <= accepted`` and ``i < drafted``.
        A probe (``probed[r]``) weighs ``probe_smoothing``: after a pause the
        request's estimate is stale."""
        positions = np.arange(self.rates.shape[1])
        tried = (positions[None, :] <= accepted[:, None]) & (positions[None, :] < drafted[:, None])
        hit = (positions[None, :] < accepted[:, None]).astype(np.float64)
        beta = self.smoothing
        if probed is not None:
            beta = np.where(probed, max(self.probe_smoothing, beta), beta)[:, None]
        rates = self.rates[slots]
        self.rates[slots] = np.where(tried, (1 - beta) * rates + beta * hit, rates)
        tried_any = tried.any(axis=0)
        if tried_any.any():
            mean_hit = hit.sum(axis=0) / np.maximum(tried.sum(axis=0), 1)
            engine = self.engine_rates
            self.engine_rates = np.where(
                tried_any, (1 - self.smoothing) * engine + self.smoothing * mean_hit, engine
            )

    def survival(self, slots: np.ndarray) -> np.ndarray:
        """``[rows, K]``: probability that draft position ``i`` is accepted."""
        return np.cumprod(self.rates[slots], axis=1)


@dataclass(frozen=True)
class DraftPlan:
    """Drafts per request for the next verification, and what it is expected to give."""

    draft_lengths: np.ndarray
    """``[rows]``: drafts per request (0: the request pauses)."""
    draft_steps: int
    """Draft forwards this step runs: the longest ``draft_lengths``."""
    expected_goodput: float
    """Tokens per second the plan is expected to reach (0 if unknown)."""
    catch_up_limits: np.ndarray | None = None
    """``[rows]``: most tokens of its gap (verified while its draft paused)
    each row catches up this step; None: all. A row left short keeps its
    frontier and reads the rest as holes (stale draft KV; the target's
    output does not change) until it drafts on its estimates."""
    draft_prefill: bool = True
    """Whether prompt chunks go through the draft this step when nobody
    drafts (False: a caught-up new request would not draft now either)."""


def choose_draft_lengths(
    survival: np.ndarray,
    drafting: np.ndarray,
    cost: StepCostModel,
    num_requests: int,
    other_tokens: int = 0,
    free_pause: bool = True,
    hysteresis: float = 0.1,
    must_draft: np.ndarray | None = None,
    resume_seconds: np.ndarray | None = None,
    draft_steps: np.ndarray | None = None,
    uniform_draft_length: int | None = None,
) -> DraftPlan:
    """The draft lengths that maximise expected goodput for the next step.

    Args:
        survival: ``[rows, K]`` acceptance probability of each draft position.
        drafting: ``[rows]`` bool, the row drafted at the previous step
            (hysteresis: a drafting row keeps a position down to
            ``(1 - hysteresis)`` of the threshold, a paused row resumes above
            ``(1 + hysteresis)``).
        cost: the step-cost model.
        num_requests: requests in the next step (prefills included).
        other_tokens: tokens verified besides the decode rows' (prefill chunks).
        free_pause: whether a step with no drafts skips the draft forward
            (otherwise vLLM's first pass still runs once).
        must_draft: ``[rows]`` bool, rows probing this step: they draft at
            least one token.
        resume_seconds: ``[rows]`` what drafting at all adds to the step for
            a row (its catch-up after a pause, amortised), beyond its tokens.
        draft_steps: ``[K + 1]`` bool, the numbers of draft steps to
            consider (None: all).
        uniform_draft_length: under FULL CUDA graphs, the drafts per
            request that keep the step in them (K); any other plan pays the
            model's ``piecewise_step`` cost, and every row drafting K is
            weighed too. None: no FULL graphs (CPU, eager, PIECEWISE only).

    Every number of draft steps ``D`` is solved at once (one array axis per
    ``D``); each keeps its own Dinkelbach iterate and stops when it
    converges, as a loop over ``D`` would.
    """
    rows, max_k = survival.shape
    must = None if must_draft is None or not must_draft.any() else must_draft
    graphs = uniform_draft_length is not None and cost.piecewise_step
    candidates = [steps for steps in range(max_k + 1)
                  if not ((must is not None and steps == 0)
                          or (draft_steps is not None and not draft_steps[steps]))]
    scale = np.where(drafting, 1.0 - hysteresis, 1.0 + hysteresis)

    def prices(positions: int, steps: list[int]) -> _PlanPrices:
        return _PlanPrices(survival[:, :positions], cost, resume_seconds, steps,
                           num_requests + other_tokens, free_pause, graphs,
                           # Only a batch of decode rows can be a FULL graph's.
                           uniform_draft_length if (graphs and other_tokens == 0
                                                    and rows == num_requests) else None)

    if max_k < 8:
        price = prices(max_k, candidates)
        lengths, objective = _dinkelbach(price, scale, must)
        price_of = [(price, index) for index in range(len(candidates))]
    else:
        # numpy sums 8 or more contiguous numbers pairwise: each D on its
        # own positions then, so that its sums are a loop's over D.
        price_of = [(prices(steps, [steps]), 0) for steps in candidates]
        solved = [_dinkelbach(price, scale, must) for price, _ in price_of]
        lengths = np.concatenate([lengths for lengths, _ in solved])
        objective = np.concatenate([objective for _, objective in solved])
    best = None
    longest = lengths.max(axis=1, initial=0)
    for index, steps in enumerate(candidates):
        price, price_index = price_of[index]
        fixed = price.fixed[price_index]
        if price.uniform_length == steps and rows:
            # Every row drafting K keeps the step in the FULL graphs: worth it
            # when the PIECEWISE step costs more than the extra drafts.
            uniform = np.full(rows, steps, dtype=np.int64)
            value = float(price.goodput(uniform, fixed, scale))
            if best is None or value > best[0]:
                best = (value, uniform, steps, fixed, price)
        chosen, value = lengths[index], float(objective[index])
        if steps and longest[index] < steps:
            # D draft steps are only what they cost if a row drafts D: the
            # row likeliest to accept its D-th draft (at batch 1 the step's
            # cost per D, not the per-token cost, decides).
            row = int(np.argmax(survival[:, steps - 1]))
            if survival[row, steps - 1] <= 0:
                continue
            chosen = chosen.copy()
            chosen[row] = steps
            value = float(price.goodput(chosen, fixed, scale))
        if best is None or value > best[0]:
            best = (value, chosen, steps, fixed, price)
    assert best is not None
    _, chosen, steps, fixed, price = best
    return DraftPlan(chosen, steps, float(price.goodput(chosen, fixed)))


class _PlanPrices:
    """Expected goodput of candidate plans (one row of draft lengths per
    number of draft steps ``D``), computed as one plan at a time would be,
    to the last bit: the choice is the same whatever the batching."""

    def __init__(self, survival: np.ndarray, cost: StepCostModel,
                 resume_seconds: np.ndarray | None, candidates: list[int], base_tokens: int,
                 free_pause: bool, graphs: bool, uniform_length: int | None) -> None:
        rows, max_k = survival.shape
        self.survival, self.rows, self.max_k = survival, rows, max_k
        self.per_token = cost.weights[1]  # verified_tokens
        self.piecewise_cost = cost.piecewise_cost
        self.uniform_length = uniform_length
        """The drafts per row that keep a step in the FULL graphs (None: none can)."""
        self.resume = np.zeros(rows) if resume_seconds is None else resume_seconds
        # (A zero resumption adds exactly nothing: its sums are skipped.)
        self.resumes = resume_seconds is not None and bool(resume_seconds.any())
        paused = cost.features(base_tokens, 0, piecewise=graphs)
        self.fixed = np.empty(len(candidates))
        """Per candidate ``D``: the step's seconds before its tokens."""
        for index, steps in enumerate(candidates):
            forwards = steps if (steps or free_pause) else 1
            features = paused.copy()
            if forwards:
                features[NUM_LINEAR_FEATURES - 1 + min(forwards, cost.max_draft_steps)] = 1.0
            self.fixed[index] = float(cost.predict(features))
        self.candidates = np.array(candidates)
        # Expected accepted drafts of a row drafting L: the sum of its first
        # L survival probabilities, left to right (as numpy sums a few).
        self.accepted_table = None
        if max_k < 8:
            self.accepted_table = np.zeros((max_k + 1, rows))
            for position in range(max_k):
                self.accepted_table[position + 1] = (self.accepted_table[position]
                                                     + survival[:, position])
        self.every_row = np.arange(rows)

    def goodput(self, lengths: np.ndarray, fixed, weights=1.0) -> np.ndarray:
        """Expected tokens per second of ``[..., rows]`` lengths with
        ``fixed`` seconds each (accepted drafts divided by ``weights``)."""
        seconds = fixed + self.per_token * lengths.sum(axis=-1)
        if self.resumes:
            # Summed over the rows that draft alone, as numpy sums one plan's.
            drafts = (lengths > 0).reshape(-1, self.rows)
            seconds = seconds + np.array([self.resume[row].sum() for row in drafts]).reshape(
                lengths.shape[:-1])
        if self.uniform_length is not None:
            seconds = seconds - np.where((lengths == self.uniform_length).all(axis=-1),
                                         self.piecewise_cost, 0.0)
        if self.accepted_table is not None:
            accepted = self.accepted_table[lengths, self.every_row]
        else:
            positions = np.arange(self.max_k)
            accepted = (self.survival * (positions < lengths[..., None])).sum(axis=-1)
        gained = self.rows + (accepted / weights).sum(axis=-1)
        positive = seconds > 0
        if positive.all():
            return gained / seconds
        return np.where(positive, gained / np.where(positive, seconds, 1.0), 0.0)


def _dinkelbach(price: _PlanPrices, scale: np.ndarray,
                must: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``[D, rows]`` lengths and ``[D]`` objectives: Dinkelbach on the
    hysteresis-weighted goodput for every candidate ``D`` at once (a
    drafting row's tokens count 1 / (1 - h), a paused row's 1 / (1 + h)): a
    position is kept when it is worth more than its verification time, a
    row drafts when its kept positions are worth more than its resumption.
    Each ``D`` stops when its iterate converges, as a loop over ``D`` would."""
    fixed, max_k, per_token, resume = price.fixed, price.max_k, price.per_token, price.resume
    objective = np.where(fixed > 0, price.rows / np.where(fixed > 0, fixed, 1.0), 0.0)
    lengths = np.zeros((len(fixed), price.rows), dtype=np.int64)
    in_reach = np.arange(max_k)[None, :] < price.candidates[:, None]  # [D, K]
    weighted = price.survival / scale[:, None]
    # Positions on the middle axis: sums over them add whole rows, in the
    # order numpy sums a few contiguous ones (left to right). From 8
    # positions on, numpy sums contiguous ones pairwise: positions last then.
    axis = 1 if max_k < 8 else 2
    if axis == 1:
        weighted, in_reach = weighted.T[None], in_reach[:, :, None]
    else:
        weighted, in_reach = weighted[None], in_reach[:, None, :]
    active = np.arange(len(fixed))
    reach = in_reach
    for _ in range(4):  # converges in a few rounds
        current = objective[active]
        margins = weighted - (current * per_token)[:, None, None]
        kept = (margins > 0) & reach
        if not max_k:
            worth, chosen = np.zeros(kept.shape[::2]), np.zeros(kept.shape[::2], dtype=np.int64)
        elif axis == 1:
            # Each position only after all before it; the kept positions'
            # margins summed left to right (a short loop over the positions
            # beats numpy's accumulate and reduce over a middle axis).
            worth = margins[:, 0] * kept[:, 0]
            chosen = kept[:, 0].astype(np.int64)
            for position in range(1, max_k):
                kept[:, position] &= kept[:, position - 1]
                worth += margins[:, position] * kept[:, position]
                chosen += kept[:, position]
        else:
            kept = np.logical_and.accumulate(kept, axis=axis)
            worth = (margins * kept).sum(axis=axis)
            chosen = kept.sum(axis=axis)
        worth = worth > (current[:, None] * resume) if price.resumes else worth > 0.0
        chosen *= worth
        if must is not None:
            np.maximum(chosen, must, out=chosen)
        lengths[active] = chosen
        new = price.goodput(chosen, fixed[active], scale)
        converged = np.abs(new - current) <= 1e-9 * np.maximum(new, 1.0)
        objective[active] = np.where(converged, current, new)
        if converged.any():
            if converged.all():
                break
            active = active[~converged]
            reach = in_reach[active]
    return lengths, objective


WARM_UP_PLANS = {0: "warm-up", 1: "warm-up", 2: "pause", 3: "pause"}
PROBE_INTERVAL = 16
"""Paused plans before a paused request's first probe."""
MAX_PROBE_BACKOFF = 8
"""A failing request is probed at most every 8 x ``probe_interval`` plans."""
UNLIMITED = np.iinfo(np.int64).max


@dataclass(frozen=True)
class ControlParameters:
    """The goodput controller's tuning (the defaults are the engine's)."""

    probe_interval: int = PROBE_INTERVAL
    """Paused plans before a paused request's first probe."""
    max_probe_backoff: int = MAX_PROBE_BACKOFF
    """A request whose probes keep failing is probed at most every
    ``max_probe_backoff`` x ``probe_interval`` plans (each probe doubles its
    wait)."""
    probe_budget: float = 0.02
    """Share of a paused request's time (its share of the steps it paused
    in) that its next probe may cost: so probes and explorations cost at most
    about 2% of the engine's time, whatever a catch-up costs on this
    machine. Prompts nobody would draft for get the same share of the steps
    nobody drafts in."""
    min_probe_catch_up: int = 8
    """Recent tokens a probe catches up at least (a probe waits until its
    budget covers them)."""
    explore_interval: int = 64
    """Plans between two explorations (plans that depart from the choice so
    the cost model keeps seeing every number of draft steps)."""
    hysteresis: float = 0.1
    """A drafting row keeps a position down to ``1 - hysteresis`` of the
    threshold, a paused row resumes above ``1 + hysteresis``."""
    stall_factor: float = 4.0
    """A step of a known kind this many times its prediction is a stall (an
    idle engine), not a cost: the cost model skips it."""
    slow_step_clip: float = 1.5
    """A slower step of a known kind is learnt as this many times its
    prediction (winsorised: the model still follows a lasting change, a few
    percent a step)."""
    acceptance_smoothing: float = 0.2
    """EWMA weight of a drafting request's latest verification."""
    probe_smoothing: float = PROBE_SMOOTHING
    """EWMA weight of a probe's outcome: after a pause the estimate is stale."""
    acceptance_prior: float = 0.7
    """Acceptance of every position before the engine has verified any."""
    cost_forgetting: float = 0.98
    """Weight of the step-cost model's past per observed step."""
    cost_ridge: float = 1e-6
    """The step-cost model's ridge term (relative to its data)."""


@dataclass(frozen=True)
class StepOutcome:
    """What the engine did with the last plan, beyond the lengths the next
    plan's batch shows (None: not reported)."""

    draft_forwards: int | None = None
    """Draft forwards the step ran (0: skipped; one first pass when rows
    prefill or the drafter cannot skip)."""
    catch_up_tokens: int = 0
    """Tokens its first pass caught up (verified while the draft paused)."""
    deferred_prefill_tokens: int = 0
    """Prompt tokens it did not run through the draft."""


@dataclass
class ControlStats:
    """Engine-wide counts since start."""

    drafted_request_steps: int = 0
    paused_request_steps: int = 0
    probes: int = 0
    explorations: int = 0
    """Plans after the warm-up that departed from the choice to keep the cost
    model seeing every number of draft steps."""
    skipped_draft_forwards: int = 0
    """Steps where no request drafted and the draft's forward did not run."""
    deferred_prefill_tokens: int = 0
    """Prompt tokens whose draft prefill was skipped (caught up if the
    request drafts later)."""
    catch_up_tokens: int = 0
    """Tokens the draft caught up after forwards that skipped or left them."""
    chosen_lengths: np.ndarray | None = None
    """Histogram of the drafts chosen per request-step (index: K_r)."""
    finished_paused_fractions: list[float] = field(default_factory=list)
    """Per finished request not yet folded into ``request_paused_fraction``."""
    _paused_fraction: DeviceHistogram = field(
        default_factory=lambda: DeviceHistogram(PAUSED_FRACTION_BUCKETS, torch.device("cpu")))

    @property
    def request_paused_fraction(self) -> DeviceHistogram:
        """Per finished request: paused / decode steps (folded on a metrics
        pull, not per step)."""
        self.fold()
        return self._paused_fraction

    def fold(self) -> None:
        for fraction in self.finished_paused_fractions:
            self._paused_fraction.observe(torch.tensor(fraction), torch.tensor(True))
        self.finished_paused_fractions.clear()


FOLD_AT = 4096
"""Finished requests kept unfolded at most (memory stays bounded without a
metrics pull)."""


class GoodputController:
    """Per step, the draft lengths of the next verification for every request
    of the batch, from the measured step costs and acceptance so far.

    Per step: :meth:`plan` once, at the drafter's call, with the host-side
    lengths of the batch (it first learns from the step those lengths
    show), and :meth:`observe` with what the engine did with the plan (any
    time before the next plan; several calls add up). :meth:`finish` when
    requests leave. Per-request state is held in arrays by slot
    (:class:`RequestSlots`).
    """

    def __init__(
        self,
        max_requests: int,
        num_speculative_tokens: int,
        free_pause: bool,
        parameters: ControlParameters = ControlParameters(),
        full_graph_query_len: int | None = None,
    ) -> None:
        """``full_graph_query_len``: the query length of every request in a
        decode step that runs in the target's FULL CUDA graphs (``1 + K``
        under vLLM's FULL decode graphs); None: no FULL graphs."""
        self.num_speculative_tokens = num_speculative_tokens
        self.full_graph_query_len = full_graph_query_len
        self.free_pause = free_pause
        self.parameters = parameters
        p = parameters
        self.cost = StepCostModel(num_speculative_tokens, forgetting=p.cost_forgetting,
                                  ridge=p.cost_ridge,
                                  piecewise_step=full_graph_query_len is not None)
        self.acceptance = AcceptanceEstimates(max_requests, num_speculative_tokens,
                                              smoothing=p.acceptance_smoothing,
                                              prior=p.acceptance_prior,
                                              probe_smoothing=p.probe_smoothing)
        self.stats = ControlStats(chosen_lengths=np.zeros(num_speculative_tokens + 1, np.int64))
        self.requests = RequestSlots(max_requests)
        # Per slot, between steps:
        self._context_len = np.full(max_requests, -1, dtype=np.int64)
        """Context length at the previous step (-1: not seen yet)."""
        self._verified_drafts = np.zeros(max_requests, dtype=np.int64)
        """Drafts the previous step verified (its query minus the last token);
        the next step's context tells how many were accepted."""
        self._drafted = np.full(max_requests, -1, dtype=np.int64)
        """Drafts planned at the previous step (-1: none planned)."""
        self._probed = np.zeros(max_requests, dtype=bool)
        """The previous plan's drafts were a probe."""
        self._verified_probe = np.zeros(max_requests, dtype=bool)
        """The drafts the previous step verified were a probe."""
        self._paused_steps = np.zeros(max_requests, dtype=np.int64)
        """Consecutive plans with no draft."""
        self._probe_after = np.zeros(max_requests, dtype=np.int64)
        """Paused plans before the next probe (doubles after each probe)."""
        self._drafted_steps = np.zeros(max_requests, dtype=np.int64)
        """Decode steps each request drafted in (its metrics)."""
        self._paused_decode_steps = np.zeros(max_requests, dtype=np.int64)
        """Decode steps it did not draft in."""
        self._arrival_probe_after = 0
        """Probe back-off of a new request: the latest probe's, until a
        request drafts on its estimates again (short requests would
        otherwise each pay the probes that already failed for others)."""
        self._last_time: float | None = None
        self._last_prefilling = True
        self._last_draft_forwards = 0
        self._last_catch_up_tokens = 0
        self._catch_up_timed = False
        self._plans = 0
        self._since_exploration = 0
        self._prompt_budget = 0.0
        """Seconds of draft prefill the engine may spend on prompts it would
        defer: ``probe_budget`` of every step nobody drafts in. A prompt let
        through keeps its request able to probe, so an engine whose requests
        all arrive paused still learns when drafting pays again."""

    # ---- per step --------------------------------------------------------

    def admit(self, req_ids: list[str]) -> np.ndarray:
        """Each request's slot; a new request starts from the engine's
        acceptance estimates and the latest probe back-off."""
        slots, new_rows = self.requests.assign(req_ids)
        if new_rows:
            new = slots[new_rows]
            self._context_len[new] = -1
            self._verified_drafts[new] = 0
            self._drafted[new] = -1
            self._probed[new] = False
            self._verified_probe[new] = False
            self._paused_steps[new] = 0
            self._probe_after[new] = self._arrival_probe_after
            self._drafted_steps[new] = 0
            self._paused_decode_steps[new] = 0
            self.acceptance.rates[new] = self.acceptance.engine_rates
        return slots

    def observe(self, outcome: StepOutcome) -> None:
        """What the engine did with the last plan (its cost is learnt at the
        next plan, from the clock)."""
        if outcome.draft_forwards is not None:
            self._last_draft_forwards = outcome.draft_forwards
            self.stats.skipped_draft_forwards += outcome.draft_forwards == 0
        self._last_catch_up_tokens += outcome.catch_up_tokens
        self.stats.catch_up_tokens += outcome.catch_up_tokens
        self.stats.deferred_prefill_tokens += outcome.deferred_prefill_tokens

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
        """Draft lengths for the next verification of ``req_ids`` (this step's
        batch: ``context_lens`` computed tokens before this step's
        ``query_lens``; ``catch_up_gaps``: tokens each request's draft KV is
        behind; ``whole_catch_up``: requests whose forced drafts must catch
        up all of their gap, as one whose prompt the draft lacks: with holes
        there a probe would not measure the draft), observing the step just
        verified first."""
        p = self.parameters
        slots = self.admit(req_ids)
        num_requests = len(req_ids)
        seq_lens = context_lens + query_lens
        prompting = context_lens < prompt_lens
        prefilling = bool(prompting.any())
        if not (prefilling or self._last_prefilling):
            # Decode steps only: a prefill's cost (the target's and the
            # draft's) says nothing about the choice, and would swamp it.
            self._observe_cost(int(query_lens.sum()), now, self._piecewise(query_lens))
        self._last_time, self._last_prefilling = now, prefilling
        self._last_catch_up_tokens = 0
        self._observe_acceptance(slots, context_lens, query_lens, ~prompting)
        # Rows still prefilling after this step get no drafts (vLLM drops them).
        decoding = seq_lens >= prompt_lens
        drafting = self._drafted[slots] > 0
        other_tokens = int(query_lens[~decoding].sum())
        paused_step = max(float(self.cost.predict(self.cost.features(
            num_requests + other_tokens, 0, piecewise=True))), 0.0)
        paused_steps = self._paused_steps[slots]
        budgets = self._probe_budgets(paused_steps, num_requests, paused_step)
        least = np.full(num_requests, p.min_probe_catch_up, dtype=np.int64)
        if whole_catch_up is not None and catch_up_gaps is not None:
            least = np.where(whole_catch_up, np.maximum(catch_up_gaps, least), least)
            if not self._catch_up_timed:
                # Its price unknown, a whole gap is not risked on a probe.
                budgets = np.where(whole_catch_up, 0.0, budgets)
        probe_after = self._probe_after[slots]
        due = paused_steps >= np.where(probe_after != 0, probe_after, p.probe_interval)
        probing = decoding & due
        if probing.any():
            probing &= self._affordable(budgets, 1, num_requests, least)
        survival = self.acceptance.survival(slots)
        survival[~decoding] = 0.0
        resume = self._resume_seconds(slots, catch_up_gaps, probing)
        plan = choose_draft_lengths(
            survival, drafting, self.cost, num_requests, other_tokens=other_tokens,
            free_pause=self.free_pause, hysteresis=p.hysteresis, must_draft=probing,
            resume_seconds=resume,
            uniform_draft_length=(None if self.full_graph_query_len is None
                                  else self.full_graph_query_len - 1),
        )
        chosen = plan.draft_lengths
        plan = self._explore(plan, decoding, budgets, num_requests, least)
        if plan.draft_steps == 0:
            self._prompt_budget += p.probe_budget * paused_step
            if prefilling:
                plan = replace(plan, draft_prefill=self._prompt_through_draft(
                    survival, drafting, resume, prompting, query_lens, num_requests))
        plan = self._limit_catch_up(plan, probing | (chosen == 0), budgets, num_requests,
                                    least)
        self._note_plan(slots, plan.draft_lengths, probing, decoding, chosen, paused_steps,
                        probe_after)
        self._plans += 1
        return plan

    def _note_plan(self, slots, lengths, probing, decoding, chosen, paused_steps,
                   probe_after) -> None:
        """Each request's state after this plan, and the engine's counts."""
        p = self.parameters
        drafts = lengths > 0
        self._drafted[slots] = lengths
        # Drafts not chosen on estimates (probes, warm-up, exploration)
        # weigh as probes: they may follow a pause.
        self._probed[slots] = drafts & (probing | (chosen == 0))
        self._paused_steps[slots] = np.where(drafts, 0, paused_steps + 1)
        self._drafted_steps[slots] += decoding & drafts
        self._paused_decode_steps[slots] += decoding & ~drafts
        # A request whose probes keep failing is probed less often, and so
        # are the requests that arrive after it; one drafting on its
        # estimates (not warm-up or exploration) is probed at the interval.
        probed = probing & drafts
        merit = ~probed & (chosen != 0)
        backed_off = np.minimum(2 * np.where(probe_after != 0, probe_after, p.probe_interval),
                                p.max_probe_backoff * p.probe_interval)
        self._probe_after[slots] = np.where(probed, backed_off,
                                            np.where(merit, 0, probe_after))
        changed = np.flatnonzero(probed | merit)
        if changed.size:
            last = changed[-1]
            self._arrival_probe_after = int(backed_off[last]) if probed[last] else 0
        self.stats.probes += int(probed.sum())
        decoding_lengths = lengths[decoding]
        self.stats.chosen_lengths += np.bincount(
            decoding_lengths, minlength=self.num_speculative_tokens + 1
        )
        drafted = int(np.count_nonzero(decoding_lengths))
        self.stats.drafted_request_steps += drafted
        self.stats.paused_request_steps += decoding_lengths.size - drafted

    def finish(self, req_ids) -> None:
        """Forget requests that left the batch (finished or aborted)."""
        freed = self.requests.release(req_ids)
        if not freed:
            return
        freed = np.array(freed, dtype=np.int64)
        paused = self._paused_decode_steps[freed]
        decode_steps = self._drafted_steps[freed] + paused
        stats = self.stats
        stats.finished_paused_fractions += [
            int(q) / int(d) for q, d in zip(paused.tolist(), decode_steps.tolist()) if d]
        if len(stats.finished_paused_fractions) > FOLD_AT:
            stats.fold()

    def slots(self, req_ids: list[str]) -> np.ndarray:
        """The slots of requests planned and not finished."""
        return self.requests.slots(req_ids)

    def request_figures(self) -> dict[str, dict[str, int]]:
        """Per live request: decode steps drafted and paused."""
        return {req_id: {"drafted_steps": int(self._drafted_steps[slot]),
                         "paused_steps": int(self._paused_decode_steps[slot])}
                for req_id, slot in self.requests.items()}

    # ---- internals -------------------------------------------------------

    def _piecewise(self, query_lens: np.ndarray) -> bool:
        """Whether a decode step of ``query_lens`` left the FULL CUDA graphs."""
        graph = self.full_graph_query_len
        return graph is not None and not bool((query_lens == graph).all())

    def _observe_cost(self, verified: int, now: float, piecewise: bool = False) -> None:
        last = self._last_time
        if last is None:
            return
        seconds = now - last
        features = self.cost.features(verified, self._last_draft_forwards,
                                      self._last_catch_up_tokens, piecewise)
        if self.cost.observations >= 8 and self.cost.knows(features):
            # (A step of a kind not seen lately, a catch-up or a number of
            # draft steps, shows a cost the model has yet to learn.)
            predicted = float(self.cost.predict(features))
            if predicted > 0:
                if seconds > self.parameters.stall_factor * predicted:
                    return  # an idle engine or a stall, not a step's cost
                # One slow step (a request's first retrieval, the host's
                # hiccup) moves the model as far as a 1.5x one: otherwise
                # it can price a number of draft steps out for a whole run.
                seconds = min(seconds, self.parameters.slow_step_clip * predicted)
        self.cost.observe(features, seconds)
        self._catch_up_timed |= self._last_catch_up_tokens > 0

    def _observe_acceptance(self, slots, context_lens, query_lens, decoding) -> None:
        """The previous step verified ``verified_drafts`` drafts of each
        request; the context gained since is the accepted ones + 1."""
        last_context = self._context_len[slots]
        drafted = self._verified_drafts[slots]
        verified = (drafted > 0) & (last_context >= 0) & (context_lens > last_context)
        if verified.any():
            rows = np.flatnonzero(verified)
            drafted = drafted[rows]
            accepted = np.clip(context_lens[rows] - last_context[rows] - 1, 0, drafted)
            self.acceptance.observe(slots[rows], drafted, accepted,
                                    self._verified_probe[slots[rows]])
        self._context_len[slots] = context_lens
        self._verified_drafts[slots] = np.where(decoding, query_lens - 1, 0)
        self._verified_probe[slots] = self._probed[slots]

    def _probe_budgets(self, paused_steps: np.ndarray, num_requests: int,
                       paused_step: float) -> np.ndarray:
        """``[rows]``: seconds each request's next forced drafts (a probe, an
        exploration) may cost: ``probe_budget`` of its share of the steps it
        paused in since it last drafted (``paused_step``: this batch's
        predicted step without drafts)."""
        return (self.parameters.probe_budget * paused_step / num_requests
                * paused_steps.astype(np.float64))

    def _prompt_through_draft(self, survival, drafting, resume, prompting: np.ndarray,
                              query_lens: np.ndarray, num_requests: int) -> bool:
        """Whether this step's prompt chunks go through the draft when nobody
        drafts: where a new request would draft, or within the prompt budget."""
        if self._new_request_drafts(survival, drafting, resume, prompting, num_requests):
            return True
        cost = self._catch_up_seconds() * int(query_lens[prompting].sum())
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
        untimed one looks free (the choice learns it by trying), which is no
        reason to pay a prompt's draft prefill."""
        fresh = np.cumprod(self.acceptance.engine_rates)
        seen = self.cost.draft_steps_seen()
        plan = choose_draft_lengths(
            np.where(prompting[:, None], fresh[None, :], survival), drafting & ~prompting,
            self.cost, num_requests, free_pause=self.free_pause,
            hysteresis=self.parameters.hysteresis,
            resume_seconds=None if resume is None else np.where(prompting, 0.0, resume),
            draft_steps=seen if seen[1:].any() else None)
        return bool(plan.draft_lengths[prompting].any())

    def _resume_seconds(self, slots: np.ndarray, gaps: np.ndarray | None,
                        probing: np.ndarray) -> np.ndarray | None:
        """``[rows]``: what drafting on its estimates adds to a row's step:
        catching up its gap, once, spread over as many steps as the request
        has decoded (at least a probe interval; it is expected to run about
        as long again). A probe's catch-up is its budget's."""
        if gaps is None:
            return None
        decoded = self._drafted_steps[slots] + self._paused_decode_steps[slots]
        horizon = np.maximum(decoded, self.parameters.probe_interval)
        return np.where(probing, 0.0, gaps * self._catch_up_seconds() / horizon)

    def _forced_draft_seconds(self, draft_lengths: np.ndarray | int,
                              num_requests: int) -> np.ndarray:
        """What a row's forced drafts add to a step, catch-up aside: their
        verification and the row's share of the draft forwards."""
        weights = self.cost.weights
        per_steps = weights[NUM_LINEAR_FEATURES:NUM_LINEAR_FEATURES + self.num_speculative_tokens]
        forwards = np.maximum(np.concatenate(([0.0], per_steps)), 0.0)
        return draft_lengths * weights[1] + forwards[draft_lengths] / num_requests

    def _catch_up_seconds(self) -> float:
        """Seconds per caught-up token: learnt once a catch-up was timed, at
        most a verified token's (a draft's token costs no more than the
        target's: one small catch-up's step can put all its noise on its
        few tokens); before, a verified token's, so resumptions and prompts
        are not priced as free."""
        verified = float(self.cost.weights[1])
        return min(float(self.cost.weights[2]), verified) if self._catch_up_timed else verified

    def _forced_catch_up_seconds(self) -> float:
        """Seconds per token a forced draft's catch-up is priced at: none
        until a catch-up was timed, since the engine's first forced drafts
        catch up only ``min_probe_catch_up`` tokens, which times the price.
        (A verified token's price overstates it where the steps cannot tell
        the base from a token: at batch 1, half of a paused step. A whole
        gap is not forced before: ``plan``'s ``whole_catch_up``.)"""
        return self._catch_up_seconds() if self._catch_up_timed else 0.0

    def _affordable(self, budgets: np.ndarray, draft_steps: int, num_requests: int,
                    least: np.ndarray) -> np.ndarray:
        """``[rows]``: the budget covers ``draft_steps`` forced drafts and
        the least catch-up (``least`` tokens)."""
        return budgets >= (self._forced_draft_seconds(draft_steps, num_requests)
                           + self._forced_catch_up_seconds() * least)

    def _limit_catch_up(self, plan: DraftPlan, forced: np.ndarray, budgets: np.ndarray,
                        num_requests: int, least: np.ndarray) -> DraftPlan:
        """Catch-up limits: a row drafting on its estimates catches up all of
        its gap, a paused row none, a row drafting by force (probe, warm-up,
        exploration) what its budget buys beyond its drafts, and at least
        ``least`` (only that until a catch-up was timed)."""
        lengths = plan.draft_lengths
        limits = np.where(lengths > 0, UNLIMITED, 0)
        forced = forced & (lengths > 0)
        per_catch_up = self._forced_catch_up_seconds()
        if forced.any() and not self._catch_up_timed:
            limits = np.where(forced, least, limits)
        elif forced.any() and per_catch_up > 0:
            left = budgets - self._forced_draft_seconds(lengths, num_requests)
            affordable = np.floor(np.maximum(left, 0.0) / per_catch_up)
            allowance = np.maximum(np.minimum(affordable, UNLIMITED // 2).astype(np.int64),
                                   least)
            limits = np.where(forced, allowance, limits)
        return replace(plan, catch_up_limits=limits)

    def _explore(self, plan: DraftPlan, decoding: np.ndarray, budgets: np.ndarray,
                 num_requests: int, least: np.ndarray) -> DraftPlan:
        """Warm-up: two plans at full K, then two with no drafts; after that,
        every ``explore_interval`` plans, one that departs from the choice:
        every row drafting D (D cycling through 1..K) or, while some rows
        draft, every other time none. The cost model then keeps seeing every
        number of draft steps. A row not drafting on its estimates joins an
        exploring draft only when its probe budget covers it (the
        exploration waits for one that does)."""
        if not decoding.any():
            return plan
        kind = WARM_UP_PLANS.get(self._plans)
        if kind is None:
            self._since_exploration += 1
            if self._since_exploration < self.parameters.explore_interval:
                return plan
            pause = plan.draft_steps > 0 and self.stats.explorations % 2 == 0
            kind = "pause" if pause else "draft"
        if kind == "warm-up":
            lengths = np.where(decoding, self.num_speculative_tokens, 0)
            return DraftPlan(lengths, self.num_speculative_tokens, plan.expected_goodput)
        if kind == "draft":
            steps = 1 + (self.stats.explorations // 2) % self.num_speculative_tokens
            rows = decoding & ((plan.draft_lengths > 0)
                               | self._affordable(budgets, steps, num_requests, least))
            if not rows.any():
                return plan  # until a budget covers it
            plan = DraftPlan(np.where(rows, steps, 0), steps, plan.expected_goodput)
        else:
            plan = DraftPlan(np.zeros_like(plan.draft_lengths), 0, plan.expected_goodput)
        if self._plans not in WARM_UP_PLANS:
            self.stats.explorations += 1
            self._since_exploration = 0
        return plan
