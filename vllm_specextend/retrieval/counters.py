"""Counters of what retrieval did, for benchmarks and metrics.

Everything is accumulated on the device (no host sync in the drafting loop)
and read only by ``as_dict``, outside the engine step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_specextend.common.histograms import DeviceHistogram
from vllm_specextend.retrieval.refresh import REFRESH_CAUSES

KEPT_FRACTION_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1.0)
ACCEPTANCE_LENGTH_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)

# Columns of the per-request accumulators (one row per request slot).
CONTEXT, KEPT, DRAFT_STEPS, ACCEPTED = range(4)
FINISHED_ROWS = 64
"""Leaving requests' figures kept before they are folded into the
histograms together (a departure costs two small copies, not a fold)."""


@dataclass
class RetrievalStats:
    """Totals since engine start, and per request while it runs."""

    max_num_reqs: int
    device: torch.device
    refreshes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFRESH_CAUSES, 0))
    """Per-request selections recomputed, by cause (``core.refresh.REFRESH_CAUSES``)."""
    compacted_request_steps: int = 0
    """Request-steps drafted through a compacted block table."""
    finished_requests: int = 0
    """Requests retrieval served that have left the batch."""
    _totals: torch.Tensor = field(init=False, repr=False)
    _per_slot: torch.Tensor = field(init=False, repr=False)
    _finished: torch.Tensor = field(init=False, repr=False)
    _unfolded: int = field(default=0, init=False, repr=False)
    """Rows of ``_finished`` not yet in the histograms."""

    @property
    def retrievals(self) -> int:
        """Per-request selections recomputed, whatever the cause."""
        return sum(self.refreshes.values())

    def __post_init__(self) -> None:
        # context, kept, draft steps, accepted (acceptance lengths summed).
        self._totals = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._per_slot = torch.zeros(
            self.max_num_reqs, 4, dtype=torch.int64, device=self.device
        )
        self._finished = torch.zeros(FINISHED_ROWS, 4, dtype=torch.int64, device=self.device)
        self._kept_fraction = DeviceHistogram(KEPT_FRACTION_BUCKETS, self.device)
        self._acceptance_length = DeviceHistogram(ACCEPTANCE_LENGTH_BUCKETS, self.device)

    @property
    def request_kept_fraction(self) -> DeviceHistogram:
        """Per finished request: kept tokens / context tokens."""
        self._fold_finished()
        return self._kept_fraction

    @property
    def request_acceptance_length(self) -> DeviceHistogram:
        """Per finished request that verified drafts: mean tokens per verification."""
        self._fold_finished()
        return self._acceptance_length

    def record_step(
        self,
        slots: torch.Tensor,
        context_tokens: torch.Tensor,
        removed_tokens: torch.Tensor,
        acceptance_lengths: torch.Tensor,
    ) -> None:
        """One drafting step of the requests in ``slots``.

        ``acceptance_lengths``: tokens each request gained at the verification
        that preceded this step; 0 where nothing was verified (no drafts).
        """
        context = context_tokens.to(torch.int64)
        step = torch.stack(
            [
                context,
                context - removed_tokens.to(torch.int64),
                (acceptance_lengths > 0).to(torch.int64),
                acceptance_lengths.to(torch.int64),
            ],
            dim=1,
        )
        self._per_slot.index_add_(0, slots, step)
        self._totals += step.sum(dim=0)
        self.compacted_request_steps += int(slots.shape[0])

    def record_rows(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        removed_tokens: torch.Tensor,
        last_token_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> None:
        """:meth:`record_step` for the batch ``rows`` of requests in
        ``slots``, from the step's tensors (indexed by batch row): a row
        verified drafts when its query held more than one token, and gained
        its last accepted token's offset + 1. (On CUDA the planner's rewrite
        kernel records the same: ``selection_triton.select_and_rewrite_decode_rows``.)"""
        first = query_start_loc[rows]
        verified = query_start_loc[rows + 1] - first > 1
        gained = last_token_indices[rows] - first + 1
        self.record_step(slots, seq_lens[rows], removed_tokens[rows],
                         torch.where(verified, gained, 0))

    @property
    def device_counters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per_slot, totals)``, for kernels that record steps themselves
        (``selection_triton.select_and_rewrite_decode_rows``)."""
        return self._per_slot, self._totals

    def finish_request(self, slot: int) -> None:
        """A leaving request's figures, kept for the histograms (folded in
        :data:`FINISHED_ROWS` at a time, or when they are read)."""
        self._finished[self._unfolded].copy_(self._per_slot[slot])
        self._unfolded += 1
        self.finished_requests += 1
        self.clear_slot(slot)
        if self._unfolded == FINISHED_ROWS:
            self._fold_finished()

    def _fold_finished(self) -> None:
        if not self._unfolded:
            return
        rows = self._finished[: self._unfolded].to(torch.float64)
        self._kept_fraction.observe(
            rows[:, KEPT] / rows[:, CONTEXT].clamp(min=1), rows[:, CONTEXT] > 0
        )
        self._acceptance_length.observe(
            rows[:, ACCEPTED] / rows[:, DRAFT_STEPS].clamp(min=1), rows[:, DRAFT_STEPS] > 0
        )
        self._unfolded = 0

    def clear_slot(self, slot: int) -> None:
        self._per_slot[slot].zero_()

    def request_figures(self, slot: int) -> dict[str, float]:
        context, kept, steps, accepted = self._per_slot[slot].tolist()
        return {
            "kept_fraction": kept / context if context else 1.0,
            "mean_acceptance_length": accepted / steps if steps else 0.0,
            "verifications": steps,
        }

    def as_dict(self) -> dict[str, float]:
        context, kept, steps, accepted = self._totals.tolist()
        return {
            "retrievals": self.retrievals,
            "refreshes": dict(self.refreshes),
            "compacted_request_steps": self.compacted_request_steps,
            "context_tokens": context,
            "kept_tokens": kept,
            "kept_fraction": kept / context if context else 1.0,
            "mean_acceptance_length": accepted / steps if steps else 0.0,
            "finished_requests": self.finished_requests,
        }

