"""The shared per-step planner: which rows are planned as decodes, and what
the draft's view of their KV cache is (no engine)."""

from types import SimpleNamespace

import numpy as np
import torch

from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.retrieval.kernels.selection import rewrite_block_table
from vllm_specextend.retrieval.planner import RetrievalPlanner, decode_rows

K = 4
BLOCK_SIZE = 16


def planning_batch(req_ids, query_lens, context_lens, prompt_lens, max_blocks=256):
    query_lens, context_lens = np.array(query_lens), np.array(context_lens)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
    num_reqs = len(req_ids)
    return PlanningBatch(
        req_ids=list(req_ids),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(context_lens + query_lens, dtype=torch.int32),
        # Request i owns blocks i * max_blocks, i * max_blocks + 1, ...
        block_table=torch.arange(num_reqs * max_blocks, dtype=torch.int32).view(num_reqs, -1),
        last_token_indices=torch.tensor(query_start_loc[1:] - 1),
        positions=torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)]),
        query_lens_cpu=query_lens,
        context_lens_cpu=context_lens,
        prompt_lens_cpu=np.array(prompt_lens),
    )


def streaming_planner(**options) -> RetrievalPlanner:
    config = SpecExtendConfig(mode="streaming", min_context_tokens=1024, sink_tokens=16,
                              recent_tokens=64, chunk_size=32, top_k_chunks=2, **options)
    planner = RetrievalPlanner(config, max_num_reqs=8, max_model_len=4096,
                               max_num_speculative_tokens=K, draft_window=4096,
                               compact_positions=False, device=torch.device("cpu"))
    planner.bind_kv_cache(tap=None, block_size=BLOCK_SIZE)
    return planner


# Rows: decode at full K; decode at a reduced K (dynamic K); the last prompt
# chunk of 3 <= K + 1 tokens; a first prompt chunk; a preempted request
# recomputing its output (context past the prompt, long query).
ROWS = dict(
    req_ids=["full_k", "reduced_k", "last_chunk", "first_chunk", "recompute"],
    query_lens=[K + 1, 2, 3, 512, 64],
    context_lens=[3000, 3000, 2997, 0, 2500],
    prompt_lens=[1000, 1000, 3000, 3000, 2000],
)


def test_decode_rows_by_prompt_progress_and_the_configured_k():
    decodes = decode_rows(np.array(ROWS["query_lens"]), np.array(ROWS["context_lens"]),
                          np.array(ROWS["prompt_lens"]), K)
    assert decodes.tolist() == [True, True, False, False, False]
    # (The rule "query <= this step's K + 1" takes the last prompt chunk for
    # a decode, and, when the proposal's K drops to 1, rows still verifying
    # K drafts for prefills.)


def test_only_long_decode_rows_are_compacted_and_tracked():
    planner = streaming_planner()
    batch = planning_batch(**ROWS)
    view = planner.plan(batch)
    assert view is not None
    assert (view.removed_tokens[:2] > 0).all()
    assert view.removed_tokens[2:].tolist() == [0, 0, 0]
    assert torch.equal(view.block_table[2:], batch.block_table[2:])
    assert sorted(planner.tracked_requests()) == ["full_k", "reduced_k"]
    # Streaming keeps the sink block, the 2 most recent whole chunks before
    # the recent window (from block (3000 - 64) // 16 = 183 on) and the
    # window itself: the pure rewrite of that selection is what the draft gets.
    keep = torch.zeros_like(batch.block_table, dtype=torch.bool)
    keep[:, 0] = True
    keep[:, 178:182] = True
    keep[:, 183:] = True
    keep[2:] = True
    expected_table, expected_removed = rewrite_block_table(batch.block_table, keep, BLOCK_SIZE)
    assert torch.equal(view.block_table, expected_table)
    assert torch.equal(view.removed_tokens, expected_removed)


def test_a_step_with_reduced_k_keeps_the_request_and_its_selection():
    planner = streaming_planner(retrieval_interval=4)
    first = planner.plan(planning_batch(["a"], [K + 1], [3000], [1000]))
    # The next step verified fewer drafts (K dropped to 1 for this batch).
    second = planner.plan(planning_batch(["a"], [2], [3003], [1000]))
    assert first is not None and second is not None
    assert planner.metrics_snapshot()["requests"]["a"]["refreshes"]["first"] == 1  # the selection is reused
    assert planner.stats.refreshes == {"first": 1, "interval": 0, "acceptance": 0}
    assert second.removed_tokens[0] == first.removed_tokens[0]


def test_short_contexts_and_prefills_leave_the_view_stock():
    planner = streaming_planner()
    assert planner.plan(planning_batch(["short", "chunk"], [K + 1, 3], [500, 2997],
                                       [400, 3000])) is None
    assert planner.tracked_requests() == {}


def to_device(batch: PlanningBatch, device) -> PlanningBatch:
    moved = {name: getattr(batch, name).to(device)
             for name in ("query_start_loc", "seq_lens", "block_table", "last_token_indices",
                          "positions")}
    return PlanningBatch(**{**batch.__dict__, **moved})


def test_mode_off_drafts_stock_and_drops_request_state():
    planner = streaming_planner()
    assert planner.plan(planning_batch(**ROWS)) is not None
    planner.reconfigure(SpecExtendConfig(mode="off"))
    assert planner.plan(planning_batch(**ROWS)) is None
    assert planner.tracked_requests() == {}


def test_the_last_prompt_chunk_already_attends_to_what_the_target_picks():
    # Compact positions, cmr: a prompt longer than the draft's window is
    # prefilled over sink + recent blocks, but the chunk that ends the prompt
    # also gets the chunk the target's last prompt token attends to, so the
    # first drafts after the prompt (a needle's answer) already see it.
    from vllm_specextend.retrieval.target_tap import TargetAttentionTap

    window, heads, head_dim = 1024, 2, 8
    config = SpecExtendConfig(mode="cmr", sink_tokens=16, recent_tokens=64, chunk_size=32,
                              top_k_chunks=2, retrieval_interval=2)
    planner = RetrievalPlanner(config, max_num_reqs=4, max_model_len=4096,
                               max_num_speculative_tokens=K, draft_window=window,
                               compact_positions=True, device=torch.device("cpu"))
    layer = SimpleNamespace(num_heads=heads, num_kv_heads=heads, head_size=head_dim)
    planner.allocate_scoring_workspace(layer, torch.float32)
    tap = TargetAttentionTap(num_slots=256 * BLOCK_SIZE, max_num_tokens=1024, num_heads=heads,
                             num_kv_heads=heads, head_dim=head_dim, scale=1.0,
                             dtype=torch.float32, device=torch.device("cpu"))
    planner.bind_kv_cache(tap, BLOCK_SIZE)
    needle_blocks = [20, 21]  # chunk 10: positions 320-351, far before the recent blocks
    tap.keys[needle_blocks[0] * BLOCK_SIZE:(needle_blocks[1] + 1) * BLOCK_SIZE] = 4.0
    context, query = 2488, 512

    def view_of_chunk(prompt_len):
        batch = planning_batch([f"prompt{prompt_len}"], [query], [context], [prompt_len])
        tap.queries[:query] = 0.0
        tap.queries[query - 1] = 4.0  # the last token of the chunk looks for the needle
        view = planner.plan(batch)
        assert view is not None
        assert view.kept_context_lens[0] + query + K <= window
        kept = view.block_table[0, :-(-(context + query - view.removed_tokens[0]) // BLOCK_SIZE)]
        return set(kept.tolist())

    assert set(needle_blocks) <= view_of_chunk(prompt_len=context + query)
    assert not set(needle_blocks) & view_of_chunk(prompt_len=context + query + 1000)
    assert planner.tracked_requests() == {}  # prefills keep no request state
