"""When a request's retrieval is due: its first selection, a fixed interval,
or (``retrieval_refresh: acceptance``) a drop of its acceptance.

The acceptance is read from lengths the host already has: the context a
request gained between two steps is the tokens accepted at the verification
in between plus one, out of the drafts that verification held (the previous
query minus one). In the V1 runner a selection made at step ``r`` drafts from
step ``r`` on, is verified at ``r + 1`` and shows in the lengths of ``r + 2``
(one step later with async scheduling, whose lengths run ahead).
"""

from __future__ import annotations

from dataclasses import dataclass

REFRESH_CAUSES = ("first", "interval", "acceptance")
"""Why a request retrieved: it had no selection yet, its selection reached
``retrieval_interval`` steps, or its acceptance dropped."""

LEVEL_WEIGHT = 0.25
"""EWMA weight of a new observation in a request's acceptance level."""
RECENT_WEIGHT = 0.5
"""EWMA weight of a new observation in its current selection's acceptance."""
MIN_OBSERVATIONS = 2
"""Observations of a selection before a drop can trigger a refresh."""
SELECTION_LAG = 2
"""Steps after a retrieval before the lengths measure its drafts."""


@dataclass
class AcceptanceTrend:
    """One request's draft acceptance: its level over all verifications and
    the recent level under its current selection."""

    last_context_len: int = -1
    last_query_len: int = 0
    level: float = -1.0
    """Drafts accepted / drafted, EWMA over every observation (-1: none yet)."""
    recent: float = -1.0
    """The same over the current selection's observations (-1: none yet)."""
    observations: int = 0
    """Observations of the current selection."""

    def observe(self, context_len: int, query_len: int, steps_since_retrieval: int) -> None:
        """This step's lengths: what the previous verification accepted."""
        gained = context_len - self.last_context_len
        drafts = self.last_query_len - 1
        # Rows that prefilled, did not draft or were preempted in between say nothing.
        if self.last_context_len >= 0 and drafts > 0 and 1 <= gained <= drafts + 1:
            accepted = (gained - 1) / drafts
            self.level = _ewma(self.level, accepted, LEVEL_WEIGHT)
            if steps_since_retrieval >= SELECTION_LAG:
                self.recent = _ewma(self.recent, accepted, RECENT_WEIGHT)
                self.observations += 1
        self.last_context_len, self.last_query_len = context_len, query_len

    def dropped(self, drop: float) -> bool:
        """Whether the current selection's acceptance fell below ``1 - drop``
        of the request's level."""
        return self.observations >= MIN_OBSERVATIONS and self.recent < (1 - drop) * self.level

    def new_selection(self, cause: str) -> None:
        if cause == "acceptance":
            # What the old selection reached becomes the level: a refresh
            # that does not bring acceptance back does not repeat.
            self.level = self.recent
        self.recent, self.observations = -1.0, 0


def refresh_cause(
    has_selection: bool,
    steps_since_retrieval: int,
    trend: AcceptanceTrend,
    retrieval_interval: int,
    acceptance_drop: float | None,
) -> str | None:
    """Why the request retrieves this step (one of ``REFRESH_CAUSES``), or
    None; ``acceptance_drop`` None: the fixed interval only."""
    if not has_selection:
        return "first"
    if steps_since_retrieval >= retrieval_interval:
        return "interval"
    if acceptance_drop is not None and trend.dropped(acceptance_drop):
        return "acceptance"
    return None


def _ewma(average: float, value: float, weight: float) -> float:
    return value if average < 0 else (1 - weight) * average + weight * value
