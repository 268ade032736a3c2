"""What every adapter holds, whatever runner hosts it: an optional retrieval
(built when ``mode`` is not ``off``) and an optional goodput control, side by
side, and the request slots both keep their per-request state by. Neither
reaches through the other; the adapter's ``propose`` updates the slots with
the step's batch (their one writer), which tells both features which
requests arrived and which left, then calls each in turn."""

from __future__ import annotations

from vllm_specextend.common.request_slots import RequestSlots
from vllm_specextend.control.draft_lengths import PlannedDraftLengths
from vllm_specextend.control.speculation_control import SpeculationControl
from vllm_specextend.retrieval.owner import DraftRetrieval


class DrafterFeatures:
    """The worker's and the benchmarks' view of an adapter's two features."""

    requests: RequestSlots
    """Per-request slots and departures, for both features (updated by the
    adapter once a step, before either feature runs)."""
    retrieval: DraftRetrieval | None = None
    """Retrieval (``mode`` other than ``off``); always there in MRV2, where
    goodput control does not run."""
    control: SpeculationControl | None = None
    """Goodput control (``speculation_control``); V1 runner only."""

    def planned_draft_lengths(self) -> PlannedDraftLengths | None:
        """Drafts each request of the last plan keeps (None: no goodput
        control): what the runner cuts each request's drafts to."""
        return None if self.control is None else self.control.draft_lengths

    def metrics_snapshot(self) -> dict[str, object]:
        """Retrieval's figures and, under goodput control, the controller's."""
        snapshot = {} if self.retrieval is None else self.retrieval.metrics_snapshot()
        control = None if self.control is None else self.control.metrics_snapshot()
        if control is not None:
            snapshot["control"] = control
        return snapshot
