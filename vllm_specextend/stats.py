"""Counters of what retrieval did, for benchmarks and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RetrievalStats:
    """Totals since engine start. Token sums stay on the device (no host sync
    in the drafting loop) until ``as_dict`` reads them."""

    retrievals: int = 0
    """Per-request selections recomputed."""
    compacted_request_steps: int = 0
    """Request-steps drafted through a compacted block table."""
    _context_tokens: torch.Tensor | None = field(default=None, repr=False)
    _kept_tokens: torch.Tensor | None = field(default=None, repr=False)

    def record_step(
        self, context_tokens: torch.Tensor, removed_tokens: torch.Tensor
    ) -> None:
        context = context_tokens.sum(dtype=torch.int64)
        kept = context - removed_tokens.sum(dtype=torch.int64)
        if self._context_tokens is None:
            self._context_tokens, self._kept_tokens = context, kept
        else:
            self._context_tokens = self._context_tokens + context
            self._kept_tokens = self._kept_tokens + kept
        self.compacted_request_steps += context_tokens.shape[0]

    def as_dict(self) -> dict[str, float]:
        context = 0 if self._context_tokens is None else int(self._context_tokens)
        kept = 0 if self._kept_tokens is None else int(self._kept_tokens)
        return {
            "retrievals": self.retrievals,
            "compacted_request_steps": self.compacted_request_steps,
            "context_tokens": context,
            "kept_tokens": kept,
            "kept_fraction": kept / context if context else 1.0,
        }
