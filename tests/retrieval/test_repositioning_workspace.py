"""Re-positioning working caches writes through a workspace allocated once at
model load: however many rows a step re-selects, and however many steps, no
key-sized tensor is allocated (the float32 temporaries of rows x window x KV
heads x head dim that the earlier code made per draft layer), and the result
is the same as the plain rotation.

Mutation that fails it: the 00f0e89 ``write_working_cache`` (gather, then
``rotate_keys``) allocates key-sized float32 temporaries that grow with the
rows re-selected: ``test_many_retrievals_allocate_no_key_sized_tensor`` fails
(its largest temporary is rows x window x heads x dim x 4 bytes)."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vllm_specextend.patches.drafter_instances import swap_impl_class
from vllm_specextend.retrieval.draft_kv_copy import (
    WORKSPACE_WINDOWS,
    DraftKVCopy,
    RepositioningWorkspace,
    install_draft_kv_copy,
    repositioning_capacity,
)
from vllm_specextend.retrieval.owner import DraftRetrieval
from vllm_specextend.retrieval.repositioning import (
    RotaryLayout,
    rotate_keys,
    rotate_keys_into,
    rotation_angles,
    working_cache_slots,
)

KV_HEADS, HEAD_DIM, BLOCK, WINDOW = 2, 32, 16, 128
MAX_ROWS, BLOCKS_PER_ROW = 24, 16


class PagedLayer:
    """A draft attention layer with a slot-indexed cache, written in place."""

    def __init__(self, num_slots):
        self.kv_cache = torch.zeros(2, num_slots + 1, KV_HEADS, HEAD_DIM)
        self.impl = _Impl()


class _Impl:
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        # Padding (slot -1) lands in the cache's last, spare slot.
        slots = slot_mapping.remainder(kv_cache.shape[1])
        kv_cache[0].index_copy_(0, slots, key)
        kv_cache[1].index_copy_(0, slots, value)


def layout(is_neox_style=True, rotary_dim=HEAD_DIM):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return RotaryLayout(inv_freq=inv_freq, rotary_dim=rotary_dim, is_neox_style=is_neox_style)


@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_into_the_workspace_is_the_plain_rotation_bit_for_bit(is_neox_style, rotary_dim,
                                                                       dtype):
    torch.manual_seed(0)
    rotary = layout(is_neox_style, rotary_dim)
    keys = torch.randn(50, KV_HEADS, HEAD_DIM).to(dtype)
    cos, sin = rotation_angles(torch.arange(50) * 37, rotary)
    out = torch.empty_like(keys)
    work = torch.empty(4, 50, KV_HEADS, rotary_dim // 2)
    rotate_keys_into(keys, cos, sin, rotary, out, work)
    assert torch.equal(out, rotate_keys(keys, cos, sin, rotary))


class FreshAllocations(TorchDispatchMode):
    """Bytes of every op output that shares no storage with the op's inputs."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and \
                    tensor.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(tensor.untyped_storage().nbytes())
        return out


def owner_with_copy(workspace=None):
    torch.manual_seed(0)
    num_slots = MAX_ROWS * BLOCKS_PER_ROW * BLOCK
    layers = {"draft.0": PagedLayer(num_slots), "draft.1": PagedLayer(num_slots)}
    copy = DraftKVCopy(sorted(layers), num_slots, KV_HEADS, HEAD_DIM, layout(),
                       max_num_tokens=64, dtype=torch.float32, device=torch.device("cpu"),
                       workspace=workspace)
    for name, hooked in install_draft_kv_copy(layers, copy).items():
        swap_impl_class(layers[name], hooked)
    copy.keys[:, :num_slots] = torch.randn(2, num_slots, KV_HEADS, HEAD_DIM)
    copy.values[:, :num_slots] = torch.randn(2, num_slots, KV_HEADS, HEAD_DIM)
    return SimpleNamespace(kv_copy=copy, draft_window=WINDOW, block_size=BLOCK,
                           device=torch.device("cpu"), draft_layers=layers)


def reselect(owner, rows):
    """One step's re-selection of ``rows``: each keeps every other block, laid
    out over its own blocks (the request's in-place layout)."""
    table = torch.arange(MAX_ROWS * BLOCKS_PER_ROW, dtype=torch.int32).view(MAX_ROWS, -1)
    kept = table[:, ::2].contiguous()
    context_lens = torch.full((MAX_ROWS,), WINDOW - 5, dtype=torch.int32)
    DraftRetrieval._reposition_working_caches(owner, rows, kept, table, context_lens, WINDOW)
    return kept, table, context_lens


def test_many_retrievals_allocate_no_key_sized_tensor():
    workspace = RepositioningWorkspace(WORKSPACE_WINDOWS * WINDOW, KV_HEADS, HEAD_DIM,
                                       torch.float32, torch.device("cpu"))
    owner = owner_with_copy(workspace)
    buffers = [t.data_ptr() for t in workspace.tensors()]
    token_key_bytes = KV_HEADS * HEAD_DIM * 4
    largest = []
    for step, num_rows in enumerate([1, 3, MAX_ROWS, 7, MAX_ROWS] * 4):
        rows = (torch.arange(num_rows) + step) % MAX_ROWS
        with FreshAllocations() as allocations:
            reselect(owner, rows)
        largest.append(max(allocations.sizes))
    assert [t.data_ptr() for t in workspace.tensors()] == buffers
    # Only index tensors (8 bytes per token of one pass) are made per step,
    # whatever the number of rows: never a key-sized one.
    assert max(largest) <= workspace.capacity * 8 < workspace.capacity * token_key_bytes
    assert max(largest) < WINDOW * token_key_bytes  # not even one row's keys


def test_rows_laid_out_in_passes_equal_the_plain_rotation():
    owner = owner_with_copy(RepositioningWorkspace(3 * WINDOW, KV_HEADS, HEAD_DIM,
                                                   torch.float32, torch.device("cpu")))
    rows = torch.tensor([0, 5, 6, 11, 17, 23, 2])  # 7 rows, 3 per pass
    kept, table, context_lens = reselect(owner, rows)
    copy = owner.kv_copy
    cos, sin = rotation_angles(torch.arange(WINDOW), copy.rotary)
    for name, layer in owner.draft_layers.items():
        index = copy.layer_index[name]
        for row in rows.tolist():
            sources, valid = working_cache_slots(kept[row:row + 1], context_lens[row:row + 1],
                                                 WINDOW, BLOCK)
            targets, _ = working_cache_slots(table[row:row + 1], context_lens[row:row + 1],
                                             WINDOW, BLOCK)
            real = valid[0]
            expected = rotate_keys(copy.keys[index, sources[0]], cos, sin, copy.rotary)
            assert torch.equal(layer.kv_cache[0, targets[0][real]], expected[real])
            assert torch.equal(layer.kv_cache[1, targets[0][real]],
                               copy.values[index, sources[0][real]])


def test_a_row_longer_than_the_workspace_is_laid_out_in_several_passes():
    small = owner_with_copy(RepositioningWorkspace(WINDOW // 3, KV_HEADS, HEAD_DIM,
                                                   torch.float32, torch.device("cpu")))
    whole = owner_with_copy(RepositioningWorkspace(2 * WINDOW, KV_HEADS, HEAD_DIM,
                                                   torch.float32, torch.device("cpu")))
    rows = torch.tensor([4, 9])
    reselect(small, rows)
    reselect(whole, rows)
    for name in small.draft_layers:
        assert torch.equal(small.draft_layers[name].kv_cache, whole.draft_layers[name].kv_cache)
    assert small.draft_layers["draft.0"].kv_cache.any()


def test_workspace_is_allocated_at_model_load_before_the_kv_cache(target_model, draft_model):
    """Allocated in ``attach`` (load_model), before vLLM profiles free memory;
    the plain draft KV copy made at KV cache set-up writes through it."""
    from tests.common.test_engine_setup import capped_draft, engine_config
    from vllm_specextend.common.engine_setup import resolve_setup

    config = engine_config(target_model, spec_extend={},
                           speculative_config=capped_draft(1024)(draft_model))
    setup = resolve_setup(config)
    assert setup.compact_positions
    retrieval = DraftRetrieval(setup, max_num_reqs=4, max_model_len=2048, max_num_tokens=64,
                               dtype=torch.float32, device=torch.device("cpu"))
    target, draft = SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=16,
                                    impl=SimpleNamespace(scale=0.25)), \
        SimpleNamespace(num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    retrieval.attach({"model.layers.1.self_attn.attn": target,
                      "draft.layers.0.self_attn.attn": draft},
                     {"draft.layers.0.self_attn.attn"})
    workspace = retrieval.repositioning_workspace
    assert workspace.capacity == WORKSPACE_WINDOWS * setup.draft_window == 4096
    assert repositioning_capacity(32768) == 8192 == repositioning_capacity(2048)
    assert workspace.nbytes == RepositioningWorkspace.bytes_needed(
        workspace.capacity, KV_HEADS, HEAD_DIM, torch.float32)
