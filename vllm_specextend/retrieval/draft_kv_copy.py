"""A plain copy of the draft's KV, from which its working cache is re-positioned.

Every draft layer's KV write also lands here, indexed by KV slot, with the key
rotated back to position 0. Laying a request's working cache out at compact
positions is then a gather, one rotation, and a write through the backend's own
``do_kv_cache_update`` into the kept slots: nothing here reads a backend's
cache layout (the CPU backend packs keys per ISA).
"""

from __future__ import annotations

import torch

from vllm_specextend.retrieval.layer_hooks import impl_subclass
from vllm_specextend.retrieval.repositioning import (
    RotaryLayout,
    rotate_keys,
    rotate_keys_into,
    rotation_angles,
    rotation_angles_into,
)

WORKSPACE_WINDOWS = 4
"""Draft windows the re-positioning workspace holds: rows re-selected in one
step are laid out this many at a time..."""
WORKSPACE_TOKENS = 8192
"""...within this many tokens (about 120 MiB for 8 KV heads of 128 dimensions
in bf16; a longer row is laid out in several passes)."""


def repositioning_capacity(draft_window: int) -> int:
    """Tokens the re-positioning workspace lays out per pass."""
    return min(WORKSPACE_WINDOWS * draft_window, WORKSPACE_TOKENS)


class RepositioningWorkspace:
    """Fixed buffers that laying working caches out writes through, allocated
    once at model load (before vLLM measures free memory, so its profile
    counts them): re-positioning allocates no key-sized temporaries, however
    many rows a step re-selects."""

    def __init__(self, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = capacity
        """Tokens laid out per pass."""
        tokens = (capacity, num_kv_heads, head_dim)
        self.keys = torch.empty(tokens, dtype=dtype, device=device)
        self.rotated_keys = torch.empty(tokens, dtype=dtype, device=device)
        self.values = torch.empty(tokens, dtype=dtype, device=device)
        # Float32 halves of the rotary dimensions (the head dimension bounds them).
        self.rotation_work = torch.empty((4, capacity, num_kv_heads, head_dim // 2),
                                         dtype=torch.float32, device=device)
        self.angles = torch.empty((3, capacity, head_dim // 2), dtype=torch.float32,
                                  device=device)
        self.sources = torch.empty(capacity, dtype=torch.int64, device=device)
        self.targets = torch.empty(capacity, dtype=torch.int64, device=device)

    @staticmethod
    def bytes_needed(capacity: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        key_sized = 3 * num_kv_heads * head_dim * dtype.itemsize
        float_work = (4 * num_kv_heads + 3) * (head_dim // 2) * 4
        return capacity * (key_sized + float_work + 2 * 8)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.rotated_keys, self.values, self.rotation_work, self.angles,
                self.sources, self.targets]

    def rows_per_pass(self, tokens_per_row: int) -> int:
        return max(1, self.capacity // max(1, tokens_per_row))


class DraftKVCopy:
    """Slot-indexed draft keys (at position 0) and values, for every draft layer."""

    def __init__(
        self,
        layer_names: list[str],
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryLayout,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        workspace: RepositioningWorkspace | None = None,
    ) -> None:
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rotary = rotary.to(device)
        # One extra row absorbs the writes of padding slots (slot id < 0).
        self.padding_slot = num_slots
        shape = (len(layer_names), num_slots + 1, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.token_positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        """Positions the draft runs its tokens at in the current forward."""
        # As tensors: where(..., out=) takes no Python scalar.
        self._padding_slot = torch.tensor(num_slots, dtype=torch.int64, device=device)
        self._no_slot = torch.tensor(-1, dtype=torch.int64, device=device)
        self.workspace = workspace or RepositioningWorkspace(
            max(max_num_tokens, 1), num_kv_heads, head_dim, dtype, device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def record(self, layer_name: str, key: torch.Tensor, value: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
        """Store one layer's freshly written KV, the key rotated back to position 0."""
        layer = self.layer_index[layer_name]
        num_tokens = slot_mapping.shape[0]
        slots = torch.where(slot_mapping >= 0, slot_mapping, self.padding_slot).long()
        shape = (num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = rotation_angles(self.token_positions[:num_tokens], self.rotary)
        keys = rotate_keys(key[:num_tokens].view(shape), cos, -sin, self.rotary)
        self.keys[layer].index_copy_(0, slots, keys.to(self.keys.dtype))
        values = value[:num_tokens].view(shape)
        self.values[layer].index_copy_(0, slots, values.to(self.values.dtype))

    def write_working_cache(
        self,
        layers: dict[str, torch.nn.Module],
        sources: torch.Tensor,
        targets: torch.Tensor,
        valid: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Write the KV recorded at slots ``sources`` into the draft's cache at
        slots ``targets``, keys rotated to ``positions``, through the fixed
        workspace (``workspace.capacity`` tokens per pass).

        Args:
            layers: the draft's attention layers, by name.
            sources, targets, valid, positions: ``[num_tokens]``; invalid
                entries are skipped.
        """
        work = self.workspace
        half = self.rotary.rotary_dim // 2
        for start in range(0, sources.shape[0], work.capacity):
            end = min(start + work.capacity, sources.shape[0])
            n = end - start
            source, target = work.sources[:n], work.targets[:n]
            torch.where(valid[start:end], sources[start:end], self._padding_slot, out=source)
            torch.where(valid[start:end], targets[start:end], self._no_slot, out=target)
            angles, cos, sin = (a[:n, :half] for a in work.angles)
            rotation_angles_into(positions[start:end], self.rotary, angles, cos, sin)
            keys, values = work.keys[:n], work.values[:n]
            rotated = work.rotated_keys[:n]
            rotation_work = work.rotation_work[:, :n, :, :half]
            for name, layer in layers.items():
                index = self.layer_index[name]
                torch.index_select(self.keys[index], 0, source, out=keys)
                torch.index_select(self.values[index], 0, source, out=values)
                rotate_keys_into(keys, cos, sin, self.rotary, rotated, rotation_work)
                # The stock update: this write must not be recorded again.
                impl = layer.impl
                impl.stock_do_kv_cache_update(layer, rotated, values, layer.kv_cache, target)


def install_draft_kv_copy(
    layers: dict[str, torch.nn.Module], copy: DraftKVCopy
) -> dict[str, type]:
    """Give each draft layer's impl ``copy`` to feed; per layer name, the
    class the impl needs to feed it on every KV write
    (``patches/drafter_instances.py`` assigns it)."""
    classes = {}
    for name, layer in layers.items():
        layer.impl._specextend_kv_copy = copy
        layer.impl._specextend_layer_name = name
        classes[name] = impl_subclass(type(layer.impl), "SpecExtendCopied", _make_copied_class)
    return classes


def _make_copied_class(base: type) -> type:
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self._specextend_kv_copy.record(self._specextend_layer_name, key, value, slot_mapping)
        return base.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)

    return type(
        base.__name__,
        (base,),
        {
            "do_kv_cache_update": do_kv_cache_update,
            "stock_do_kv_cache_update": base.do_kv_cache_update,
            "__doc__": f"{base.__name__} that also feeds a DraftKVCopy.",
        },
    )
