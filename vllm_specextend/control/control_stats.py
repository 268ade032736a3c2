"""The goodput controller's engine-wide counts (its metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specextend.common.histograms import DeviceHistogram

PAUSED_FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


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
