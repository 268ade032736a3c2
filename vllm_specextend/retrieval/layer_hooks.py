"""Retrieval's hooks on vLLM's attention layers: which layer scores, which KV
cache group it shares with the draft, and the impl subclasses that feed the
tap (target) and the plain draft KV copy (draft).

A hooked layer's ``impl`` needs a direct subclass of its own class, made here
once per base class (:func:`impl_subclass`); ``patches/drafter_instances.py``
assigns it to that one impl (``impl.__class__``), so stock layers of other
engines in the process are untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_specextend.retrieval.target_tap import TargetAttentionTap

_IMPL_SUBCLASSES: dict[tuple[str, type], type] = {}


def last_target_layer(
    attention_layers: dict[str, torch.nn.Module], draft_layer_names: set[str]
) -> tuple[str, torch.nn.Module]:
    """The target's last attention layer: the one whose attention scores."""
    from vllm.model_executor.models.utils import extract_layer_index

    target_layers = {
        name: layer for name, layer in attention_layers.items()
        if name not in draft_layer_names
    }
    if not target_layers:
        raise ValueError("SpecExtend found no attention layer in the target model")
    name = max(target_layers, key=extract_layer_index)
    layer = target_layers[name]
    shared = getattr(layer, "kv_sharing_target_layer_name", None)
    if shared is not None:
        raise ValueError(
            f"SpecExtend scores with the target's last attention layer {name}, but "
            f"that layer reuses the KV cache of {shared} "
            "(kv_sharing_target_layer_name), so its keys are never written where "
            "the tap records them. Remove spec_extend for this model."
        )
    return name, layer


def kv_cache_group_of(
    kv_cache_config, target_layer_name: str, draft_layer_names: set[str]
) -> int:
    """The one KV cache group holding the scoring layer and every draft layer."""
    groups = [
        gid for gid, group in enumerate(kv_cache_config.kv_cache_groups)
        if target_layer_name in group.layer_names
        and draft_layer_names <= set(group.layer_names)
    ]
    if len(groups) != 1:
        raise ValueError(
            "SpecExtend needs the target's last attention layer and the draft's "
            "layers in one KV cache group (one shared block table); this model "
            f"has {len(kv_cache_config.kv_cache_groups)} KV cache groups "
            "(hybrid or sliding-window attention). Use a full-attention target."
        )
    return groups[0]


def tap_bytes_per_token(layer: torch.nn.Module, dtype: torch.dtype) -> int:
    """The tap's key buffer per KV slot."""
    return layer.num_kv_heads * layer.head_size * dtype.itemsize


def tap_target_layer(
    layer: torch.nn.Module,
    num_slots: int,
    max_num_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[TargetAttentionTap, type]:
    """A tap sized for ``num_slots`` KV slots, installed on ``layer``, and
    the class ``layer.impl`` needs to feed it (:func:`install_tap`)."""
    tap = TargetAttentionTap(
        num_slots=num_slots,
        max_num_tokens=max_num_tokens,
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_size,
        scale=layer.impl.scale,
        dtype=dtype,
        device=device,
    )
    return tap, install_tap(layer, tap)


def install_tap(layer: torch.nn.Module, tap: TargetAttentionTap) -> type:
    """Give ``layer.impl`` the ``tap`` to feed; the class it needs to feed it
    on every forward (``patches/drafter_instances.py`` assigns it)."""
    _require_separate_kv_update(layer)
    layer.impl._specextend_tap = tap
    return impl_subclass(type(layer.impl), "SpecExtendTapped", _make_tapped_class)


def impl_subclass(base: type, prefix: str, make_class: Callable[[type], type]) -> type:
    """``make_class(base)``, named ``prefix + base``, made once per base class
    and prefix; ``base`` itself when it is already one.

    A direct subclass of the impl's own class, because that is what
    ``impl.__class__`` can be assigned (a class with a mixin base fails with
    "object layout differs"); why an assignment at all, in
    ``patches/drafter_instances.py``."""
    if base.__name__.startswith(prefix):
        return base
    subclass = _IMPL_SUBCLASSES.get((prefix, base))
    if subclass is None:
        subclass = make_class(base)
        subclass.__name__ = f"{prefix}{base.__name__}"
        _IMPL_SUBCLASSES[(prefix, base)] = subclass
    return subclass


def _require_separate_kv_update(layer: torch.nn.Module) -> None:
    backend = layer.get_attn_backend()
    if backend.forward_includes_kv_cache_update:
        raise ValueError(
            f"SpecExtend cannot tap the attention backend {backend.get_name()}: "
            "it writes the KV cache inside its forward, so the keys never pass "
            "through do_kv_cache_update. Supported backends: those with a separate "
            "KV cache update (CPU_ATTN, FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION)."
        )


def _make_tapped_class(base: type) -> type:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if attn_metadata is not None:
            self._specextend_tap.record_queries(query)
        return base.forward(
            self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs
        )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self._specextend_tap.record_keys(key, slot_mapping)
        return base.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)

    return type(
        base.__name__,
        (base,),
        {
            "forward": forward,
            "do_kv_cache_update": do_kv_cache_update,
            "__doc__": f"{base.__name__} that also feeds a TargetAttentionTap.",
        },
    )
