"""The target tap: fixed-shape copies of queries and slot-indexed keys."""

import torch

from vllm_specextend.patches.drafter_instances import swap_impl_class
from vllm_specextend.retrieval.layer_hooks import install_tap
from vllm_specextend.retrieval.target_tap import TargetAttentionTap


def make_tap(num_slots=16, max_tokens=8):
    return TargetAttentionTap(num_slots=num_slots, max_num_tokens=max_tokens, num_heads=4,
                              num_kv_heads=2, head_dim=8, scale=0.5,
                              dtype=torch.float32, device=torch.device("cpu"))


def test_keys_land_in_their_slots_and_padding_slots_are_absorbed():
    tap = make_tap()
    key = torch.randn(5, 2 * 8)  # flattened heads, as some backends pass them
    slots = torch.tensor([3, -1, 10, 0, -1])
    tap.record_keys(key, slots)
    assert torch.equal(tap.keys[3], key[0].view(2, 8))
    assert torch.equal(tap.keys[10], key[2].view(2, 8))
    assert torch.equal(tap.keys[0], key[3].view(2, 8))
    untouched = [s for s in range(16) if s not in (0, 3, 10)]
    assert tap.keys[untouched].abs().sum() == 0


def test_queries_are_copied_up_to_the_buffer_size():
    tap = make_tap(max_tokens=4)
    query = torch.randn(6, 4, 8)  # more rows than the buffer (padded batch)
    tap.record_queries(query)
    assert torch.equal(tap.queries, query[:4])


class _Backend:
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name():
        return "FAKE"


class _Impl:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        return "forward"

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        return "update"


class _Layer:
    def __init__(self):
        self.impl = _Impl()

    def get_attn_backend(self):
        return _Backend


def test_install_tap_feeds_the_tap_and_keeps_the_impl_behaviour():
    layer, tap = _Layer(), make_tap()
    swap_impl_class(layer, install_tap(layer, tap))  # as the runner's KV cache set-up
    assert isinstance(layer.impl, _Impl)
    query, key = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    assert layer.impl.forward(layer, query, key, None, None, object()) == "forward"
    assert layer.impl.do_kv_cache_update(layer, key, None, None, torch.tensor([1, 2])) == "update"
    assert torch.equal(tap.queries[:2], query)
    assert torch.equal(tap.keys[1:3], key)
    # Profiling runs pass no metadata: nothing is recorded.
    tap.queries.zero_()
    layer.impl.forward(layer, query, key, None, None, None)
    assert tap.queries.abs().sum() == 0
    # Installing again on another layer of the same impl class reuses the subclass.
    other = _Layer()
    swap_impl_class(other, install_tap(other, make_tap()))
    assert type(other.impl) is type(layer.impl)


def test_a_scoring_layer_that_shares_another_layers_kv_is_refused():
    import types

    import pytest

    from vllm_specextend.retrieval.layer_hooks import last_target_layer

    def layer(shares=None):
        return types.SimpleNamespace(kv_sharing_target_layer_name=shares)

    layers = {"model.layers.0.attn": layer(), "model.layers.1.attn": layer(),
              "draft.layers.0.attn": layer()}
    name, _ = last_target_layer(layers, {"draft.layers.0.attn"})
    assert name == "model.layers.1.attn"
    layers["model.layers.1.attn"] = layer(shares="model.layers.0.attn")
    with pytest.raises(ValueError, match=r"last attention layer model.layers.1.attn, but "
                                         r"that layer reuses the KV cache of model.layers.0.attn"):
        last_target_layer(layers, {"draft.layers.0.attn"})
