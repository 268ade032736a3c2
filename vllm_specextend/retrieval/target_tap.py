"""Copies of the target's last-layer queries and keys, taken inside its forward.

The tap only does fixed-shape tensor copies, so it is safe inside torch.compile
(attention impls run in an opaque custom op) and inside CUDA graphs; the
scoring happens later, when the drafter plans. Keys go into a buffer of our
own, indexed by KV slot, because the backends' cache layouts differ (the CPU
backend packs keys per ISA). ``retrieval/layer_hooks.py`` installs it.
"""

from __future__ import annotations

import torch


class TargetAttentionTap:
    """Persistent query and key buffers for one attention layer."""

    def __init__(
        self,
        num_slots: int,
        max_num_tokens: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # One extra row absorbs the writes of padding slots (slot id < 0).
        self.padding_slot = num_slots
        self.keys = torch.zeros(
            num_slots + 1, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.queries = torch.zeros(
            max_num_tokens, num_heads, head_dim, dtype=dtype, device=device
        )

    def record_queries(self, query: torch.Tensor) -> None:
        num_tokens = min(query.shape[0], self.queries.shape[0])
        self.queries[:num_tokens].copy_(
            query[:num_tokens].view(num_tokens, self.num_heads, self.head_dim)
        )

    def record_keys(self, key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        num_tokens = slot_mapping.shape[0]
        slots = torch.where(
            slot_mapping >= 0, slot_mapping, self.padding_slot
        ).to(torch.int64)
        keys = key[:num_tokens].view(num_tokens, self.num_kv_heads, self.head_dim)
        self.keys.index_copy_(0, slots, keys.to(self.keys.dtype))
