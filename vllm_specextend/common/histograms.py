"""Histograms kept on the device (observed without a host sync), read as
Prometheus histograms: retrieval's and goodput control's metrics."""

from __future__ import annotations

import torch


class DeviceHistogram:
    """A Prometheus-style histogram whose observations stay on the device."""

    def __init__(self, buckets: tuple[float, ...], device: torch.device) -> None:
        self.buckets = buckets
        self._bounds = torch.tensor(buckets, dtype=torch.float64, device=device)
        # Per bucket (upper bounds, then +Inf), the sum and the count.
        self._counts = torch.zeros(len(buckets) + 1, dtype=torch.int64, device=device)
        self._sum = torch.zeros((), dtype=torch.float64, device=device)

    def observe(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Observe ``values[mask]`` without reading the mask on the host."""
        values = values.to(torch.float64).reshape(-1)
        mask = mask.reshape(-1)
        index = torch.bucketize(values, self._bounds)
        self._counts.index_add_(0, index, mask.to(torch.int64))
        self._sum += torch.where(mask, values, 0.0).sum()

    def as_dict(self) -> dict[str, object]:
        counts = self._counts.tolist()
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        return {
            "buckets": list(self.buckets),
            "cumulative_counts": cumulative,  # last entry: +Inf, the total
            "sum": float(self._sum),
            "count": cumulative[-1],
        }
