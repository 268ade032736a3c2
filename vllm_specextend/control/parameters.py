"""The goodput controller's tuning (:class:`ControlParameters`) and what the
engine reports back after each plan (:class:`StepOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_specextend.control.acceptance import PROBE_SMOOTHING

PROBE_INTERVAL = 16
"""Paused plans before a paused request's first probe."""
MAX_PROBE_BACKOFF = 8
"""A failing request is probed at most every 8 x ``probe_interval`` plans."""


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
    machine (at their predicted price per request; at what their steps
    measured engine-wide: ``ForcedDraftAccount``). Prompts nobody would draft
    for get the same share of the steps nobody drafts in."""
    min_probe_catch_up: int = 8
    """Recent tokens a probe catches up at least (a probe waits until its
    budget covers them)."""
    catch_up_growth: int = 2
    """A forced draft (probe, exploration) catches up at most this many times
    the most tokens a timed step caught up (``min_probe_catch_up`` at least):
    the catch-up's price is learnt on the catch-ups timed, and a much longer
    one can cost far more per token (a CPU draft's forward turns
    compute-bound). A request whose forced drafts must catch up more (a
    prompt the draft lacks) is not probed until catch-ups that long were
    timed."""
    explore_interval: int = 64
    """Plans between two explorations (plans that depart from the choice so
    the cost model keeps seeing every number of draft steps)."""
    hysteresis: float = 0.1
    """A drafting row keeps a position down to ``1 - hysteresis`` of the
    threshold, a paused row resumes above ``1 + hysteresis``."""
    pause_margin: float = 0.1
    """A plan that drafts must be expected to beat pausing every request by
    this share. Acceptance estimates are noisy (a few lucky drafts make a
    request look worth drafting) and a batch ends with its slowest request,
    so a plan expected to gain a few percent loses as often: in simulated
    engines (``tests/control/test_goodput_floor.py``) a margin of 0.1 kept
    every point at 0.98x the target alone or better where 0 let some fall
    to 0.94x, and left every point where drafting pays as fast."""
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


@dataclass(slots=True)
class StepOutcome:
    """What the engine did with the last plan that the plan did not decide,
    beyond the lengths the next plan's batch shows."""

    catch_up_tokens: int = 0
    """Tokens its first pass caught up (verified while the draft paused)."""
    draft_forwards: int | None = None
    """Draft forwards the step ran, where an engine ran other than the plan
    said (None: as planned, ``plan.runs_draft_forward``); simulated engines
    in the tests set it."""
