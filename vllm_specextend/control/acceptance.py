"""Per-request acceptance estimates: an EWMA of each draft position's
acceptance, from the verifications seen so far. On the host, in loops
compiled with numba (see ``choice_kernel.py``): a step's update is a few
operations per verified row."""

from __future__ import annotations

import numpy as np

from vllm_specextend.common.compiled import compiled
from vllm_specextend.common.kernel_args import flags, ints
from vllm_specextend.control.kernel_state import Estimates

PROBE_SMOOTHING = 0.5
"""EWMA weight of a probe's outcome (a drafting request's outcomes weigh
``AcceptanceEstimates.smoothing``)."""

_NO_FLAGS = np.zeros(0, dtype=bool)


class AcceptanceEstimates:
    """Per request slot and draft position: the EWMA of "accepted, given every
    earlier position was". New requests start from the engine-wide estimate."""

    def __init__(self, max_num_reqs: int, num_positions: int, smoothing: float = 0.2,
                 prior: float = 0.7, probe_smoothing: float = PROBE_SMOOTHING) -> None:
        self.smoothing = smoothing
        self.probe_smoothing = probe_smoothing
        self.engine_rates = np.full(num_positions, prior)
        self.rates = np.full((max_num_reqs, num_positions), prior)
        self._survival = np.empty((max_num_reqs, num_positions))
        """Scratch for :func:`survival_rows` (rows first)."""

    def start(self, slot: int) -> None:
        self.rates[slot] = self.engine_rates

    def observe(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
                probed: np.ndarray | None = None) -> None:
        """Verification outcomes: row ``r`` (slot ``slots[r]``) had
        ``drafted[r]`` drafts, the first ``accepted[r]`` accepted. Position
        ``i`` (0-based) was tried iff ``i <= accepted`` and ``i < drafted``.
        A probe (``probed[r]``) weighs ``probe_smoothing``: after a pause the
        request's estimate is stale."""
        _observe_outcomes(self.rates, self.engine_rates, ints(slots), ints(drafted),
                          ints(accepted), _NO_FLAGS if probed is None else flags(probed),
                          float(self.smoothing), float(self.probe_smoothing))

    def kernel_args(self) -> Estimates:
        """What a compiled caller of :func:`observe_verified` and
        :func:`survival_rows` passes."""
        return Estimates(self.rates, self.engine_rates, float(self.smoothing),
                         float(self.probe_smoothing), self._survival)


@compiled
def _observe_row(rates, slot, drafted, accepted, beta, tried, hits):
    """One verification's EWMA update; counts its tried and accepted positions."""
    for position in range(min(accepted + 1, drafted, rates.shape[1])):
        hit = 1.0 if position < accepted else 0.0
        rates[slot, position] = (1 - beta) * rates[slot, position] + beta * hit
        tried[position] += 1
        hits[position] += hit


@compiled
def _observe_engine(engine_rates, tried, hits, smoothing):
    """The engine-wide estimate follows the mean outcome of each position tried."""
    for position in range(engine_rates.shape[0]):
        if tried[position]:
            engine_rates[position] = ((1 - smoothing) * engine_rates[position]
                                      + smoothing * (hits[position] / tried[position]))


@compiled
def _observe_outcomes(rates, engine_rates, slots, drafted, accepted, probed, smoothing,
                      probe_smoothing):
    tried = np.zeros(rates.shape[1], np.int64)
    hits = np.zeros(rates.shape[1])
    probe_beta = max(probe_smoothing, smoothing)
    for row in range(slots.shape[0]):
        beta = probe_beta if (probed.size > 0 and probed[row]) else smoothing
        _observe_row(rates, slots[row], drafted[row], accepted[row], beta, tried, hits)
    _observe_engine(engine_rates, tried, hits, smoothing)


@compiled
def observe_verified(estimates, step, verifying, requests):
    """A step of the controller's batch (``step``, a ``StepRows``): per slot
    (``requests``, a ``RequestState``), ``verified_drafts`` drafts were
    verified at ``context_len`` (-1: none seen), the context gained since is
    the accepted ones + 1 (``verified_probe``: they were a probe). Then the
    step's own: its context, the drafts its query verifies (``verifying``
    rows' query - 1) and whether they were a probe (``probed``)."""
    rates = estimates.rates
    tried = np.zeros(rates.shape[1], np.int64)
    hits = np.zeros(rates.shape[1])
    probe_beta = max(estimates.probe_smoothing, estimates.smoothing)
    for row in range(step.slots.shape[0]):
        slot = step.slots[row]
        last, drafted = requests.context_len[slot], requests.verified_drafts[slot]
        context = step.context_lens[row]
        if drafted > 0 and last >= 0 and context > last:
            accepted = min(max(context - last - 1, 0), drafted)
            beta = probe_beta if requests.verified_probe[slot] else estimates.smoothing
            _observe_row(rates, slot, drafted, accepted, beta, tried, hits)
        requests.context_len[slot] = context
        requests.verified_drafts[slot] = step.query_lens[row] - 1 if verifying[row] else 0
        requests.verified_probe[slot] = requests.probed[slot]
    _observe_engine(estimates.engine_rates, tried, hits, estimates.smoothing)


@compiled
def survival_rows(rates, slots, out):
    """``np.cumprod(rates[slots], axis=1)``, into ``out``'s first rows."""
    for row in range(slots.shape[0]):
        product = 1.0
        for position in range(rates.shape[1]):
            product = rates[slots[row], position] if position == 0 else (
                product * rates[slots[row], position])
            out[row, position] = product
    return out[:slots.shape[0]]
