"""Compact draft positions against dense references (no engine).

The reference is vLLM's own rotary module: it embeds the kept tokens at
positions 0..W-1 directly. Our path stores keys as vLLM's draft wrote them
(rotated at their original positions), rotates them back into the plain copy
and forward to compact positions, as DraftRetrieval does after a retrieval.
"""

import pytest
import torch

from vllm_specextend.patches.drafter_instances import swap_impl_class
from vllm_specextend.retrieval.draft_kv_copy import DraftKVCopy, install_draft_kv_copy
from vllm_specextend.retrieval.kernels.selection import rewrite_block_table
from vllm_specextend.retrieval.repositioning import (
    RotaryLayout,
    rotate_keys,
    rotation_angles,
    streaming_recent_start_block,
    token_rows,
    working_cache_slots,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 8


@pytest.fixture(scope="module", autouse=True)
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def vllm_rope(is_neox_style: bool, rotary_dim: int, max_position: int = 4096):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    return get_rope(
        HEAD_DIM,
        max_position=max_position,
        is_neox_style=is_neox_style,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": rotary_dim / HEAD_DIM},
        dtype=torch.float32,
    )


def apply_rope(rope, positions, query, key):
    """vLLM's rotation of flat ``[tokens, heads * dim]`` query and key."""
    q, k = rope.forward_native(positions, query.flatten(1).clone(), key.flatten(1).clone())
    return q.view(query.shape), k.view(key.shape)


def attention(query, keys, values):
    """Softmax attention of one query ``[heads, dim]`` over ``[tokens, kv_heads, dim]`` (GQA)."""
    group = HEADS // KV_HEADS
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,thd->ht", query, k) / HEAD_DIM**0.5
    return torch.einsum("ht,thd->hd", logits.softmax(-1), v)


class FakePagedLayer:
    """A draft attention layer whose cache is a plain slot-indexed tensor."""

    def __init__(self, num_slots):
        self.kv_cache = torch.zeros(2, num_slots, KV_HEADS, HEAD_DIM)
        self.impl = _FakeImpl()


class _FakeImpl:
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        real = slot_mapping >= 0
        kv_cache[0, slot_mapping[real]] = key[real].view(-1, KV_HEADS, HEAD_DIM)
        kv_cache[1, slot_mapping[real]] = value[real].view(-1, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize(
    "is_neox_style, rotary_dim",
    [(True, HEAD_DIM), (False, HEAD_DIM), (True, HEAD_DIM // 2), (False, HEAD_DIM // 2)],
    ids=["neox", "gptj", "neox-partial", "gptj-partial"],
)
@pytest.mark.parametrize("private_area", [False, True], ids=["in-place", "private-area"])
def test_attention_over_repositioned_working_cache_equals_dense_compact_reference(
    is_neox_style, rotary_dim, private_area
):
    torch.manual_seed(0)
    rope = vllm_rope(is_neox_style, rotary_dim)
    layout = RotaryLayout.of_module(rope)
    context, num_blocks = 20 * BLOCK, 24
    block_table = torch.randperm(num_blocks)[:20].view(1, -1)  # one request, shuffled blocks
    num_slots = num_blocks * BLOCK
    raw_keys = torch.randn(context, KV_HEADS, HEAD_DIM)  # before RoPE
    values = torch.randn(context, KV_HEADS, HEAD_DIM)
    slots = (block_table[0, torch.arange(context) // BLOCK] * BLOCK + torch.arange(context) % BLOCK)

    # The draft wrote its KV at the original positions, through the copy's tap.
    area_blocks = 8  # private layouts: blocks past the scheduler's, for this request
    layer = FakePagedLayer(num_slots + area_blocks * BLOCK)
    copy = DraftKVCopy(["draft.0"], num_slots, KV_HEADS, HEAD_DIM, layout,
                       max_num_tokens=context, dtype=torch.float32, device=torch.device("cpu"))
    swap_impl_class(layer, install_draft_kv_copy({"draft.0": layer}, copy)["draft.0"])
    _, written_keys = apply_rope(rope, torch.arange(context), torch.zeros(context, HEADS, HEAD_DIM), raw_keys)
    copy.token_positions[:context] = torch.arange(context)
    layer.impl.do_kv_cache_update(layer, written_keys, values, layer.kv_cache, slots)
    assert torch.allclose(layer.kv_cache[0, slots], written_keys)

    # Keep the sink block, blocks 5-6 and 12, and the recent blocks 17-19.
    kept_blocks = [0, 5, 6, 12, 17, 18, 19]
    keep = torch.zeros(1, 20, dtype=torch.bool)
    keep[0, kept_blocks] = True
    compact_table, removed = rewrite_block_table(block_table, keep, BLOCK)
    kept_tokens = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in kept_blocks])
    window = 64
    kept_slots, valid = working_cache_slots(compact_table, torch.tensor([len(kept_tokens)]), window, BLOCK)
    draft_table = compact_table.clone()
    if private_area:  # the kept blocks are read from the area: the shared ones stay as written
        draft_table[0, :len(kept_blocks)] = num_blocks + torch.arange(len(kept_blocks))
    compact_slots, _ = working_cache_slots(draft_table, torch.tensor([len(kept_tokens)]), window, BLOCK)
    copy.write_working_cache({"draft.0": layer}, kept_slots.flatten(), compact_slots.flatten(),
                             valid.flatten(), torch.arange(window))
    if private_area:
        assert torch.equal(layer.kv_cache[0, slots], written_keys)
    assert int(removed) == context - len(kept_tokens)

    # The query of the next token runs at compact position len(kept).
    raw_query = torch.randn(1, HEADS, HEAD_DIM)
    compact_query_position = torch.tensor([len(kept_tokens)])
    query, _ = apply_rope(rope, compact_query_position, raw_query, torch.zeros(1, KV_HEADS, HEAD_DIM))
    ours = attention(query[0], layer.kv_cache[0, compact_slots[0, : len(kept_tokens)]],
                     layer.kv_cache[1, compact_slots[0, : len(kept_tokens)]])

    # Dense reference: the kept tokens embedded at positions 0..W-1 directly.
    _, dense_keys = apply_rope(rope, torch.arange(len(kept_tokens)),
                               torch.zeros(len(kept_tokens), HEADS, HEAD_DIM), raw_keys[kept_tokens])
    reference = attention(query[0], dense_keys, values[kept_tokens])
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)

    # The original positions (query at the context's end) give another result:
    # removing blocks changes the kept tokens' distances to the query.
    _, original_keys = apply_rope(rope, kept_tokens, torch.zeros(len(kept_tokens), HEADS, HEAD_DIM),
                                  raw_keys[kept_tokens])
    original_query, _ = apply_rope(rope, torch.tensor([context]), raw_query,
                                   torch.zeros(1, KV_HEADS, HEAD_DIM))
    at_original = attention(original_query[0], original_keys, values[kept_tokens])
    assert not torch.allclose(at_original, reference, atol=1e-3)


def test_rotating_by_minus_then_plus_is_identity_and_matches_vllm_for_scaled_rope():
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope = get_rope(HEAD_DIM, max_position=8192, is_neox_style=True,
                    rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 1024},
                    dtype=torch.float32)
    layout = RotaryLayout.of_module(rope)
    plain = RotaryLayout(1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)),
                         HEAD_DIM, True)
    assert not torch.allclose(layout.inv_freq, plain.inv_freq)  # scaled frequencies were taken
    keys = torch.randn(6, KV_HEADS, HEAD_DIM)
    positions = torch.tensor([0, 1, 100, 1000, 5000, 8000])
    cos, sin = rotation_angles(positions, layout)
    _, reference = apply_rope(rope, positions, torch.zeros(6, HEADS, HEAD_DIM), keys)
    torch.testing.assert_close(rotate_keys(keys, cos, sin, layout), reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rotate_keys(reference, cos, -sin, layout), keys, rtol=1e-4, atol=1e-4)


def test_token_rows_maps_flat_tokens_to_their_request_and_padding_past_the_end():
    query_start_loc = torch.tensor([0, 3, 4, 8])
    assert token_rows(query_start_loc, 10).tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 3, 3]


def test_streaming_prefill_view_fits_the_window_and_keeps_the_query_block():
    window, sink_blocks, lookahead = 64, 1, 3
    query_start = torch.tensor([0, 30, 100, 301])
    query_lens = torch.tensor([40, 20, 24, 16])
    start = streaming_recent_start_block(query_start, query_lens, lookahead, sink_blocks, window, BLOCK)
    kept = sink_blocks * BLOCK + (query_start + query_lens - start * BLOCK)
    assert (start >= sink_blocks).all()
    assert (kept + lookahead <= window).all()
    query_block = query_start // BLOCK
    assert ((query_block < sink_blocks) | (start <= query_block)).all()
