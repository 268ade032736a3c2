"""What every adapter holds, whatever runner hosts it: an optional retrieval
and an optional goodput control, side by side. Neither reaches through the
other; the adapter's ``propose`` calls each in turn."""

from __future__ import annotations

from vllm_specextend.control.owner import DraftControl
from vllm_specextend.core.options import SpecExtendConfig, SpecExtendConfigError
from vllm_specextend.retrieval.owner import DraftRetrieval


class DrafterFeatures:
    """The worker's and the benchmarks' view of an adapter's two features."""

    retrieval: DraftRetrieval
    control: DraftControl | None = None
    """Goodput control (``speculation_control``); V1 runner only."""

    def bytes_per_kv_token_outside_cache(self) -> int:
        return self.retrieval.bytes_per_kv_token_outside_cache()

    def reconfigure(self, config: SpecExtendConfig) -> None:
        """Switch options between requests (the benchmarks); mode ``off``
        drafts as stock vLLM does. Goodput control switches only in an
        engine built with it."""
        if config.controls_speculation and self.control is None:
            raise SpecExtendConfigError(
                "spec_extend option speculation_control='goodput' needs an engine built "
                "with it (vLLM's synchronous scheduler); build the engine with it instead")
        self.retrieval.reconfigure(config)
        if self.control is not None:
            self.control.reconfigure(config)

    def metrics_snapshot(self) -> dict[str, object]:
        """Retrieval's figures and, under goodput control, the controller's."""
        snapshot = self.retrieval.metrics_snapshot()
        control = None if self.control is None else self.control.metrics_snapshot()
        if control is not None:
            snapshot["control"] = control
        return snapshot
