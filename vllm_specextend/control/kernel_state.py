"""The state goodput control's compiled loops take, named: one record per
concern (numba passes a named tuple of arrays and scalars as one argument
and reads its fields by name), so a loop takes a few records rather than a
dozen positional arrays, and a new per-request or per-row field is one line
here and one where it is used.

Arrays are contiguous, of one dtype each (``common/kernel_args.py``), so
every loop compiles once per process (when a drafter's ``SpeculationControl`` is built:
``control/warm_up.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class RequestState(NamedTuple):
    """Goodput control's state of each request, by request slot, between
    steps (updated in place by the loops)."""

    context_len: np.ndarray
    """int64: context length at the previous step (-1: not seen yet)."""
    verified_drafts: np.ndarray
    """int64: drafts the previous step verified; the next step's context
    tells how many were accepted."""
    drafted: np.ndarray
    """int64: drafts planned at the previous step (-1: none planned)."""
    probed: np.ndarray
    """bool: the previous plan's drafts were a probe."""
    verified_probe: np.ndarray
    """bool: the drafts the previous step verified were a probe."""
    paused_steps: np.ndarray
    """int64: consecutive plans with no draft."""
    probe_after: np.ndarray
    """int64: paused plans before the next probe (0: the probe interval;
    doubles after each probe)."""
    drafted_steps: np.ndarray
    """int64: decode steps the request drafted in (its metrics)."""
    paused_decode_steps: np.ndarray
    """int64: decode steps it did not draft in."""
    max_output_tokens: np.ndarray
    """int64: the most tokens the request may generate (its ``max_tokens``;
    ``UNLIMITED`` where not told): no draft is planned past them."""

    @classmethod
    def new(cls, max_num_reqs: int) -> RequestState:
        ints = lambda fill: np.full(max_num_reqs, fill, dtype=np.int64)  # noqa: E731
        flags = lambda: np.zeros(max_num_reqs, dtype=bool)  # noqa: E731
        return cls(context_len=ints(-1), verified_drafts=ints(0), drafted=ints(-1),
                   probed=flags(), verified_probe=flags(), paused_steps=ints(0),
                   probe_after=ints(0), drafted_steps=ints(0), paused_decode_steps=ints(0),
                   max_output_tokens=ints(np.iinfo(np.int64).max))


class RowScratch(NamedTuple):
    """Per row of a plan (its first rows), what the loops work out on the
    way: scratch, allocated once for ``max_num_reqs`` rows."""

    verifying: np.ndarray
    """bool: the row's query verifies drafts (its prompt was in before)."""
    decoding: np.ndarray
    """bool: the row decodes after this step, with room for a draft before
    its ``max_output_tokens``."""
    draft_caps: np.ndarray
    """int64: the most drafts that can count in its next verification
    (``max_output_tokens``; 0 where it does not decode)."""
    drafting: np.ndarray
    """bool: the row drafted at the previous plan."""
    probing: np.ndarray
    """bool: the row probes this step."""
    least_catch_up: np.ndarray
    """int64: the least of its gap a forced draft catches up."""
    paused: np.ndarray
    """int64: its consecutive paused plans."""
    probe_after: np.ndarray
    """int64: its probe back-off."""
    budget: np.ndarray
    """float64: seconds its forced drafts may cost."""
    resume: np.ndarray
    """float64: seconds drafting at all adds to its step (its catch-up,
    amortised)."""

    @classmethod
    def new(cls, max_num_reqs: int) -> RowScratch:
        flags = lambda: np.zeros(max_num_reqs, dtype=bool)  # noqa: E731
        ints = lambda: np.zeros(max_num_reqs, dtype=np.int64)  # noqa: E731
        floats = lambda: np.zeros(max_num_reqs)  # noqa: E731
        return cls(verifying=flags(), decoding=flags(), draft_caps=ints(), drafting=flags(),
                   probing=flags(), least_catch_up=ints(), paused=ints(), probe_after=ints(),
                   budget=floats(), resume=floats())


class StepRows(NamedTuple):
    """A step's rows as the controller's plan reads them."""

    slots: np.ndarray
    """int64: each row's request slot."""
    context_lens: np.ndarray
    """int64: tokens before each row's query."""
    query_lens: np.ndarray
    """int64: each row's query this step."""
    prompt_lens: np.ndarray
    """int64: each row's prompt."""
    gaps: np.ndarray
    """int64: verified tokens each row's draft KV lacks (empty: not given)."""
    whole: np.ndarray
    """bool: rows whose forced drafts must catch up all of their gap
    (empty: not given)."""


class Estimates(NamedTuple):
    """Acceptance estimates (``AcceptanceEstimates``): per slot and draft
    position, and the engine's, with their smoothing and a scratch for each
    row's survival."""

    rates: np.ndarray
    """float64 ``[max_num_reqs, K]``: per slot, each position's EWMA."""
    engine_rates: np.ndarray
    """float64 ``[K]``: the engine-wide estimate new requests start from."""
    smoothing: float
    """EWMA weight of a drafting request's latest verification."""
    probe_smoothing: float
    """EWMA weight of a probe's outcome."""
    survival: np.ndarray
    """float64 ``[max_num_reqs, K]``: scratch, each row's survival."""


class StepCosts(NamedTuple):
    """What the step-cost model prices a step with."""

    weights: np.ndarray
    """float64: the model's weights (``cost_model.cost_features``)."""
    max_draft_steps: int
    piecewise_step: bool
    """The model has the ``piecewise_step`` feature (FULL CUDA graphs)."""
    most_catch_up_timed: int
    """The most tokens a learnt step caught up (``StepCostModel``; 0: no
    catch-up was timed, its price is not learnt)."""


class CostFit(NamedTuple):
    """The step-cost model's sums, updated in place by each fitted step."""

    gram: np.ndarray
    """float64 ``[features, features]``: the weighted sums of feature products."""
    moment: np.ndarray
    """float64 ``[features]``: the weighted sums of feature x seconds."""
    seen: np.ndarray
    """bool ``[features]``: features some observed step had."""


class FitSettings(NamedTuple):
    """How the step-cost model fits (``ControlParameters``)."""

    forgetting: float
    ridge: float
    piecewise_step: bool


class ChoiceSettings(NamedTuple):
    """How the K choice weighs plans (``ControlParameters``)."""

    hysteresis: float
    pause_margin: float
    free_pause: bool
    """A step with no drafts skips the draft's forward."""


class PlanSettings(NamedTuple):
    """The controller's tuning as the loops take it (``ControlParameters``)."""

    probe_budget: float
    min_probe_catch_up: int
    probe_interval: int
    max_probe_backoff: int
    choice: ChoiceSettings
    catch_up_growth: int
    """A forced draft catches up at most this many times the most tokens a
    timed step caught up (``ControlParameters``)."""


class StepShape(NamedTuple):
    """What a step's price depends on beyond its rows' drafts."""

    num_requests: int
    """Requests in the step (prefills included)."""
    other_tokens: int
    """Tokens verified besides the decode rows' (prefill chunks)."""
    uniform_draft_length: int
    """Under FULL CUDA graphs, the drafts per request that keep the step in
    them (K); -1: no FULL graphs."""


class PlanShape(NamedTuple):
    """What a plan's price depends on beyond its rows (``plan_rows``)."""

    other_tokens: int
    """Tokens verified besides the decode rows' (prefill chunks)."""
    uniform_draft_length: int
    """As ``StepShape``'s."""
    settle: bool
    """No exploration may change the plan: settle it in the same call."""


class FrontierState(NamedTuple):
    """Speculation control's draft-KV state of each request, by slot."""

    frontier: np.ndarray
    """int64: every position before it has the right draft KV (-1: new)."""
    synced: np.ndarray
    """bool: the last forward wrote the request's verified tokens."""
    deferred: np.ndarray
    """bool: its draft prefill was deferred, until caught up."""
    lagging: np.ndarray
    """bool: left behind its frontier by the last step."""
    lag_table: np.ndarray
    """int64 ``[max_num_reqs, blocks]``: a lagging request's block table."""
    lag_start: np.ndarray
    """int64: its first lagging block (its frontier's)."""
    lag_end: np.ndarray
    """int64: one past its last lagging block."""

    @classmethod
    def new(cls, max_num_reqs: int) -> FrontierState:
        # lag_table takes the block table's width at the first step.
        return cls(frontier=np.full(max_num_reqs, -1, dtype=np.int64),
                   synced=np.zeros(max_num_reqs, dtype=bool),
                   deferred=np.zeros(max_num_reqs, dtype=bool),
                   lagging=np.zeros(max_num_reqs, dtype=bool),
                   lag_table=np.zeros((max_num_reqs, 0), dtype=np.int64),
                   lag_start=np.zeros(max_num_reqs, dtype=np.int64),
                   lag_end=np.zeros(max_num_reqs, dtype=np.int64))


class BlockTable(NamedTuple):
    """A step's rows' KV block ids on the host (vLLM's int32, or int64) and
    the block size; no rows: block tables not kept."""

    table: np.ndarray
    size: int
