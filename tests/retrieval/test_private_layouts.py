"""Private draft layouts (no engine): two running requests share a cached
document's blocks at different compact positions. Laid out in place, the
second request's re-positioning overwrites the first's keys in the shared
blocks; with private layouts each reads its own layout through its view."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.retrieval.test_repositioning import HEAD_DIM, KV_HEADS, FakePagedLayer
from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.patches.drafter_instances import swap_impl_class
from vllm_specextend.retrieval.draft_kv_copy import DraftKVCopy, install_draft_kv_copy
from vllm_specextend.retrieval.owner import DraftRetrieval
from vllm_specextend.retrieval.planner import PrivateLayouts, RetrievalPlanner
from vllm_specextend.retrieval.repositioning import (
    RotaryLayout,
    rotate_keys,
    rotation_angles,
    working_cache_slots,
)

K, BLOCK, WINDOW = 3, 16, 256
DOCUMENT_BLOCKS, OWN_BLOCKS, NUM_BLOCKS = 40, 8, 64


def shared_document_batch(question_lens: list[int]) -> PlanningBatch:
    """Decode rows of requests whose first DOCUMENT_BLOCKS blocks are the
    same cached blocks, each followed by its own question and answer."""
    num_reqs = len(question_lens)
    context = np.array([DOCUMENT_BLOCKS * BLOCK + q for q in question_lens])
    query = np.full(num_reqs, K + 1)
    table = torch.zeros(num_reqs, DOCUMENT_BLOCKS + OWN_BLOCKS, dtype=torch.int32)
    table[:, :DOCUMENT_BLOCKS] = torch.arange(DOCUMENT_BLOCKS)
    for row in range(num_reqs):
        table[row, DOCUMENT_BLOCKS:] = DOCUMENT_BLOCKS + row * OWN_BLOCKS + torch.arange(OWN_BLOCKS)
    starts = np.concatenate([[0], np.cumsum(query)])
    return PlanningBatch(
        req_ids=[f"question{row}" for row in range(num_reqs)],
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(context + query, dtype=torch.int32),
        block_table=table,
        last_token_indices=torch.tensor(starts[1:] - 1),
        positions=torch.cat([torch.arange(c, c + q) for c, q in zip(context, query)]),
        query_lens_cpu=query,
        context_lens_cpu=context,
        prompt_lens_cpu=context,
    )


@pytest.mark.parametrize("private", [False, True], ids=["in-place", "private"])
def test_each_request_reads_its_own_layout_of_shared_blocks(private):
    torch.manual_seed(0)
    layout = RotaryLayout(inv_freq=1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM),
                          rotary_dim=HEAD_DIM, is_neox_style=True)
    # Streaming keeps the sink, the latest whole chunks and the recent
    # window: with questions of different lengths, the document's last blocks
    # sit at a different compact position in each request.
    config = SpecExtendConfig(mode="streaming", sink_tokens=16, recent_tokens=64, chunk_size=16,
                              top_k_chunks=4, min_context_tokens=0)
    planner = RetrievalPlanner(config, max_num_reqs=2, max_model_len=2048,
                               max_num_speculative_tokens=K, draft_window=WINDOW,
                               compact_positions=True, device=torch.device("cpu"))
    areas = PrivateLayouts(first_block=NUM_BLOCKS, areas=2, blocks_per_area=WINDOW // BLOCK)
    planner.bind_kv_cache(tap=None, block_size=BLOCK, private_layouts=areas if private else None)
    num_slots = NUM_BLOCKS * BLOCK
    layer = FakePagedLayer(num_slots + 2 * WINDOW)
    copy = DraftKVCopy(["draft.0"], num_slots, KV_HEADS, HEAD_DIM, layout, max_num_tokens=64,
                       dtype=torch.float32, device=torch.device("cpu"))
    swap_impl_class(layer, install_draft_kv_copy({"draft.0": layer}, copy)["draft.0"])
    copy.keys[0, :num_slots] = torch.randn(num_slots, KV_HEADS, HEAD_DIM)  # at position 0
    owner = SimpleNamespace(kv_copy=copy, draft_window=WINDOW, block_size=BLOCK,
                            device=torch.device("cpu"), draft_layers={"draft.0": layer})

    batch = shared_document_batch(question_lens=[8, 40])
    view = planner.plan(batch)
    kept_table = view.block_table if view.kept_block_table is None else view.kept_block_table
    for rewrite in view.rewrites:
        DraftRetrieval._reposition_working_caches(
            owner, rewrite.rows, kept_table, view.block_table, view.kept_context_lens,
            rewrite.max_context_len)

    laid_out_right = []
    for row in range(2):
        kept, lens = int(view.kept_context_lens[row]), view.kept_context_lens[row:row + 1]
        read, _ = working_cache_slots(view.block_table[row:row + 1], lens, kept, BLOCK)
        source, _ = working_cache_slots(kept_table[row:row + 1], lens, kept, BLOCK)
        cos, sin = rotation_angles(torch.arange(kept), layout)
        expected = rotate_keys(copy.keys[0, source[0]], cos, sin, layout)
        laid_out_right.append(torch.allclose(layer.kv_cache[0, read[0]], expected, atol=1e-5))
    shifts = view.removed_tokens[:2].tolist()
    assert shifts[0] != shifts[1]  # the shared blocks' compact positions differ
    if private:
        assert laid_out_right == [True, True]
        # Nothing was written into the shared document blocks (only the
        # block holding each query start, the request's own, is in place).
        assert not layer.kv_cache[0, :DOCUMENT_BLOCKS * BLOCK].any()
    else:
        # Both write their layout into the same shared slots: at most one
        # reads its own (which write lands per slot is not defined when the
        # rows are re-positioned in one scatter), so some request drafts over
        # keys at another request's positions.
        assert laid_out_right != [True, True]
