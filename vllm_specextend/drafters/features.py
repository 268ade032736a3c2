"""What every adapter holds, whatever runner hosts it: an optional retrieval
(built when ``mode`` is not ``off``) and an optional goodput control, side by
side. Neither reaches through the other; the adapter's ``propose`` calls each
in turn."""

from __future__ import annotations

from vllm_specextend.control.owner import DraftControl
from vllm_specextend.retrieval.owner import DraftRetrieval


class DrafterFeatures:
    """The worker's and the benchmarks' view of an adapter's two features."""

    retrieval: DraftRetrieval | None = None
    """Retrieval (``mode`` other than ``off``); always there in MRV2, where
    goodput control does not run."""
    control: DraftControl | None = None
    """Goodput control (``speculation_control``); V1 runner only."""

    def metrics_snapshot(self) -> dict[str, object]:
        """Retrieval's figures and, under goodput control, the controller's."""
        snapshot = {} if self.retrieval is None else self.retrieval.metrics_snapshot()
        control = None if self.control is None else self.control.metrics_snapshot()
        if control is not None:
            snapshot["control"] = control
        return snapshot
