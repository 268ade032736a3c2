"""Block selection and table rewriting, and the dense scoring references
themselves against loop forms; no engine."""

import math
import types

import pytest
import torch

from tests.dense_reference import attention_scores, chunk_scores, context_keys
from vllm_specextend.patches.drafter_instances import hook_attention_impls
from vllm_specextend.retrieval.kernels.selection import rewrite_block_table, select_blocks


def dense_scores(q, k, pos, scale):
    """Per-head softmax over positions <= pos, summed over heads, loop form."""
    batch, rows, heads, _ = q.shape
    group = heads // k.shape[2]
    out = torch.zeros(batch, rows, k.shape[1], dtype=torch.float64)
    for b in range(batch):
        for r in range(rows):
            if pos[b, r] < 0:
                continue
            n = int(pos[b, r]) + 1
            for h in range(heads):
                logits = (k[b, :n, h // group].double() @ q[b, r, h].double()) * scale
                out[b, r, :n] += torch.softmax(logits, 0)
    return out


def test_attention_scores_match_dense_softmax_with_gqa():
    torch.manual_seed(0)
    q = torch.randn(2, 3, 8, 16)
    k = torch.randn(2, 50, 2, 16)
    pos = torch.tensor([[49, 30, -1], [10, 0, 25]])
    got = attention_scores(q, k, pos, scale=1 / math.sqrt(16))
    want = dense_scores(q, k, pos, 1 / math.sqrt(16))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # Each valid row sums to the number of heads; padding rows are zero.
    torch.testing.assert_close(got.sum(-1)[0], torch.tensor([8.0, 8.0, 0.0]))


TP_BLOCK_SIZE, TP_CHUNK, TP_K = 16, 32, 3
TP_SEQ_LENS = [256, 201]


def tensor_parallel_step(k_context: torch.Tensor, q: torch.Tensor):
    """One verification step of two rows (K + 1 tokens each, ending at
    ``TP_SEQ_LENS``) over keys ``k_context``, every query token ``q[row]``:
    the planning batch, its slot mapping, the flat queries and keys."""
    from tests.retrieval.test_planner import planning_batch

    seq_lens = torch.tensor(TP_SEQ_LENS)
    batch = planning_batch(["a", "b"], [TP_K + 1] * 2, (seq_lens - TP_K - 1).tolist(),
                           [100, 100], max_blocks=16)
    positions = torch.arange(256)
    valid = positions.view(1, -1) < seq_lens.view(-1, 1)
    slots = (batch.block_table[:, positions // TP_BLOCK_SIZE].long() * TP_BLOCK_SIZE
             + positions % TP_BLOCK_SIZE)
    queries = q[:, 0].repeat_interleave(TP_K + 1, dim=0)
    return batch, slots[valid], k_context[valid], queries


def _tensor_parallel_rank(rank: int, port: int, q: torch.Tensor, k: torch.Tensor,
                          out_dir: str) -> None:
    """One tensor-parallel rank (a process of its own): vLLM's distributed
    state over gloo, then the drafter's retrieval (``DraftRetrieval``, as the
    V1 and MRV2 adapters build it) tapping this rank's slice of the target's
    last layer, planning one step."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from tests.drafters.fakes import FakeAttention
    from vllm_specextend.common.engine_setup import EngineSetup
    from vllm_specextend.common.options import SpecExtendConfig
    from vllm_specextend.retrieval.owner import DraftRetrieval

    init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(tensor_model_parallel_size=2, backend="gloo")
    config = SpecExtendConfig(mode="cmr", min_context_tokens=128, sink_tokens=32,
                              recent_tokens=16, chunk_size=TP_CHUNK, top_k_chunks=2)
    setup = EngineSetup(config=config, method="draft_model", draft_window=256,
                           num_speculative_tokens=TP_K, compact_positions=False,
                           steps_in_flight=2)
    retrieval = DraftRetrieval(setup, max_num_reqs=2, max_model_len=256, max_num_tokens=64,
                               dtype=torch.float32, device=torch.device("cpu"))
    # This rank's heads: 4 of the 8 query heads, 2 of the 4 KV heads.
    target, draft = FakeAttention(scale=0.25), FakeAttention()
    retrieval.attach({"model.layers.0.self_attn.attn": target,
                      "draft_model.model.layers.0.self_attn.attn": draft},
                     {"draft_model.model.layers.0.self_attn.attn"})
    kv_cache_config = types.SimpleNamespace(num_blocks=32, kv_cache_groups=[
        types.SimpleNamespace(layer_names=list(retrieval.draft_layers)
                              + ["model.layers.0.self_attn.attn"])])
    retrieval.bind_kv_cache(kv_cache_config, TP_BLOCK_SIZE)
    hook_attention_impls(retrieval)  # as the runner's KV cache set-up
    heads, kv_heads = slice(4 * rank, 4 * rank + 4), slice(2 * rank, 2 * rank + 2)
    batch, slots, keys, queries = tensor_parallel_step(k[:, :, kv_heads], q[:, :, heads])
    # The target's forward over the context and the step: the tap records.
    keys = keys.flatten(1)
    target.impl.do_kv_cache_update(target, keys, keys, None, slots)
    target.impl.forward(target, queries.flatten(1), None, None, None, attn_metadata=object())
    view = retrieval.plan(batch)
    torch.save({"block_table": view.block_table.clone(),
                "removed_tokens": view.removed_tokens.clone()}, f"{out_dir}/rank{rank}.pt")


def test_tensor_parallel_ranks_plan_the_full_models_selection(tmp_path):
    """Each rank scores with its own slice of the query and KV heads; the
    planner sums the per-rank chunk scores with vLLM's tensor-parallel
    all-reduce, so every rank's drafter plans the view the full model's
    attention picks. Two gloo ranks, each running ``DraftRetrieval.plan``
    over a tap fed by its slice. Mutations that fail it:
    ``sum_over_tensor_parallel_ranks`` returning its input (no all-reduce);
    the planner not calling its ``sum_over_ranks``; ``DraftRetrieval`` not
    handing the rank sum to its planner."""
    from torch import multiprocessing

    from benchmarks.serve import free_port

    torch.manual_seed(1)
    q = torch.randn(2, 1, 8, 16)
    k = torch.randn(2, 256, 4, 16)
    # Rank 0's heads (KV heads 0-1) favour chunk 2 and, less, chunk 5; rank
    # 1's (KV heads 2-3) chunk 4 and, less, chunk 1: each rank alone keeps
    # another pair than the whole model (chunks 2 and 4).
    for kv_head, chunk, strength in ((0, 2, 3.0), (1, 5, 1.0), (2, 4, 3.0), (3, 1, 1.0)):
        towards = q[:, 0, 2 * kv_head : 2 * kv_head + 2].mean(1)
        # Scale 0.25 and |q| ~ 4: a logit of about ``strength`` over the chunk.
        towards = towards / towards.norm(dim=-1, keepdim=True) * strength / 0.25 / 4
        k[:, 32 * chunk : 32 * chunk + 32, kv_head] += towards[:, None]
    batch = tensor_parallel_step(k, q)[0]
    seq_lens = torch.tensor(TP_SEQ_LENS)
    pos = (seq_lens - 1).view(-1, 1)

    def view_of(token_scores):
        """The planner's rules: sink 2 blocks, the top 2 chunks ending before
        the recent window (16 tokens before the query), the window."""
        recent_start = (seq_lens - TP_K - 1 - 16) // TP_BLOCK_SIZE
        keep = select_blocks(chunk_scores(token_scores, seq_lens, TP_CHUNK), recent_start,
                             top_k_chunks=2, sink_blocks=2, blocks_per_chunk=2, num_blocks=16)
        return keep, rewrite_block_table(batch.block_table, keep, TP_BLOCK_SIZE)

    want_keep, (want_table, want_removed) = view_of(attention_scores(q, k, pos, 0.25).sum(1))
    assert kept(want_keep[0]) == [0, 1, 4, 5, 8, 9, 14, 15]
    assert kept(want_keep[1]) == [0, 1, 4, 5, 8, 9, 11, 12, 13, 14, 15]
    # A rank selecting from its own heads alone would keep other blocks.
    for rank in range(2):
        alone = attention_scores(q[:, :, 4 * rank : 4 * rank + 4],
                                 k[:, :, 2 * rank : 2 * rank + 2], pos, 0.25).sum(1)
        assert not torch.equal(view_of(alone)[0], want_keep)
    multiprocessing.spawn(_tensor_parallel_rank, args=(free_port(), q, k, str(tmp_path)),
                          nprocs=2)
    for rank in range(2):
        view = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(view["block_table"], want_table), rank
        assert torch.equal(view["removed_tokens"], want_removed), rank


def test_context_keys_follow_the_block_table():
    block_size, heads, dim = 4, 2, 3
    buffer = torch.randn(10 * block_size + 1, heads, dim)
    table = torch.tensor([[7, 2, 5, 0], [1, 9, 0, 0]])
    keys = context_keys(buffer, table, max_context_len=10, block_size=block_size)
    for b in range(2):
        for t in range(10):
            slot = int(table[b, t // block_size]) * block_size + t % block_size
            assert torch.equal(keys[b, t], buffer[slot])


def test_chunk_scores_mean_over_valid_tokens_only():
    scores = torch.arange(10, dtype=torch.float32).view(1, 10).repeat(2, 1)
    got = chunk_scores(scores, torch.tensor([10, 5]), chunk_size=4)
    want = torch.tensor([[1.5, 5.5, 8.5], [1.5, 4.0, 0.0]])
    torch.testing.assert_close(got, want)


def kept(mask):
    return torch.nonzero(mask).flatten().tolist()


def test_select_blocks_keeps_sink_topk_and_everything_from_recent_start():
    score = torch.tensor([[0.9, 0.1, 0.5, 0.7, 0.2, 0.8, 0.0, 0.0]])
    keep = select_blocks(score, torch.tensor([6]), top_k_chunks=2, sink_blocks=1,
                         blocks_per_chunk=1, num_blocks=10)
    # Chunk 0 is the sink (not a candidate); top-2 of chunks 1..5 are 5 and 3.
    assert kept(keep[0]) == [0, 3, 5, 6, 7, 8, 9]


def test_select_blocks_multi_block_chunks_only_whole_chunks_before_recent():
    score = torch.tensor([[0.0, 0.2, 0.9, 0.1]])  # chunks of 2 blocks
    keep = select_blocks(score, torch.tensor([5]), top_k_chunks=1, sink_blocks=1,
                         blocks_per_chunk=2, num_blocks=8)
    # Chunk 2 (blocks 4-5) crosses the recent start (5): not a candidate;
    # chunk 1 (blocks 2-3) wins; block 1 is in no candidate chunk.
    assert kept(keep[0]) == [0, 2, 3, 5, 6, 7]


def test_select_blocks_context_shorter_than_sink_plus_recent_keeps_all():
    keep = select_blocks(torch.zeros(1, 2), torch.tensor([0]), top_k_chunks=4,
                         sink_blocks=2, blocks_per_chunk=1, num_blocks=3)
    assert keep.all()


def test_select_blocks_topk_larger_than_chunks_keeps_every_candidate():
    keep = select_blocks(torch.rand(1, 4), torch.tensor([4]), top_k_chunks=50,
                         sink_blocks=1, blocks_per_chunk=1, num_blocks=6)
    assert keep.all()


def test_select_blocks_ties_pick_earlier_chunks():
    keep = select_blocks(torch.ones(1, 8), torch.tensor([8]), top_k_chunks=2,
                         sink_blocks=0, blocks_per_chunk=1, num_blocks=8)
    assert kept(keep[0]) == [0, 1]


def test_select_blocks_chunk_ending_exactly_at_recent_start_is_a_candidate():
    score = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    keep = select_blocks(score, torch.tensor([4]), top_k_chunks=1, sink_blocks=0,
                         blocks_per_chunk=1, num_blocks=5)
    assert kept(keep[0]) == [3, 4]


def test_select_blocks_is_batched_per_row():
    score = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    keep = select_blocks(score, torch.tensor([3, 4]), top_k_chunks=1, sink_blocks=0,
                         blocks_per_chunk=1, num_blocks=5)
    assert kept(keep[0]) == [1, 3, 4]
    assert kept(keep[1]) == [2, 4]


def test_rewrite_block_table_keeps_order_and_partial_last_block_last():
    table = torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 0, 0, 0]])
    keep = torch.tensor([[1, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    compact, removed = rewrite_block_table(table, keep, block_size=16)
    assert compact[0, :4].tolist() == [11, 13, 15, 16]
    assert compact[1].tolist() == table[1].tolist()
    assert removed.tolist() == [32, 0]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_attention_through_rewritten_table_equals_dense_kept_reference(dtype, atol):
    """vLLM's own CPU paged-attention kernel, fed the compacted table, attends
    exactly to the kept tokens at their original positions."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 32, 4, 2, 64
    context, num_blocks = 200, 12
    isa = _get_attn_isa(dtype, block_size, dim)
    key_cache = torch.zeros(num_blocks, kv_heads, block_size, dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    block_ids = torch.randperm(num_blocks)[:7].to(torch.int32)  # 7 blocks >= 201 tokens
    keys = torch.randn(context + 1, kv_heads, dim, dtype=dtype)
    values = torch.randn(context + 1, kv_heads, dim, dtype=dtype)
    positions = torch.arange(context + 1)
    slots = block_ids[positions // block_size].long() * block_size + positions % block_size
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    query = torch.randn(1, heads, dim, dtype=dtype)  # the token at position 200
    scale = 1 / math.sqrt(dim)

    def kernel(table, seq_len):
        out = torch.empty(1, heads, dim, dtype=dtype)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32)
        qsl = torch.tensor([0, 1], dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
            seq_lens=seq_lens, dtype=dtype, query_start_loc=qsl, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=False,
        )
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=seq_lens, scale=scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=meta, s_aux=None,
        )
        return out

    keep = torch.tensor([[1, 0, 0, 1, 0, 1, 1]], dtype=torch.bool)  # 6 = partial last
    compact, removed = rewrite_block_table(block_ids.view(1, -1), keep, block_size)
    got = kernel(compact, context + 1 - int(removed))

    kept_positions = torch.cat([torch.arange(b * block_size, min((b + 1) * block_size, context + 1))
                                for b in (0, 3, 5, 6)])
    group = heads // kv_heads
    want = torch.empty(1, heads, dim)
    for h in range(heads):
        k = keys[kept_positions, h // group].float()
        v = values[kept_positions, h // group].float()
        p = torch.softmax(k @ query[0, h].float() * scale, 0)
        want[0, h] = p @ v
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)
    full = kernel(block_ids.view(1, -1), context + 1)
    assert (full.float() - want).abs().max() > 20 * atol
