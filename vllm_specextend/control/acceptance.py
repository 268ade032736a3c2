"""Per-request acceptance estimates: an EWMA of each draft position's
acceptance, from the verifications seen so far. Pure numpy on the host."""

from __future__ import annotations

import numpy as np


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
