"""Block selection and table rewriting, and the dense scoring references
themselves against loop forms; no engine."""

import math

import pytest
import torch

from tests.dense_reference import attention_scores, chunk_scores, context_keys
from vllm_specextend.core.selection import rewrite_block_table, select_blocks


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


def _tensor_parallel_rank(rank: int, port: int, partials: list, out_dir: str) -> None:
    """One tensor-parallel rank (a process of its own): vLLM's distributed state
    over gloo, then the package's sum over ranks of this rank's partial scores."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from vllm_specextend.retrieval.owner import sum_over_tensor_parallel_ranks

    init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(tensor_model_parallel_size=2, backend="gloo")
    torch.save(sum_over_tensor_parallel_ranks(partials[rank].clone()), f"{out_dir}/rank{rank}.pt")


def test_tensor_parallel_ranks_sum_partial_scores_and_select_alike(tmp_path):
    """Each rank scores with its own slice of the query and KV heads; the
    planner sums the per-rank chunk scores with vLLM's tensor-parallel
    all-reduce (``retrieval/owner.py::sum_over_tensor_parallel_ranks``), run
    here by two gloo ranks. The sum is the full model's score, so every rank
    keeps the same blocks. Mutation: ``sum_over_tensor_parallel_ranks``
    returning its input unchanged (no all-reduce) fails the comparison."""
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
    pos = torch.tensor([[255], [200]])
    seq_lens = torch.tensor([256, 201])
    full = attention_scores(q, k, pos, scale=0.25)
    partials = [chunk_scores(attention_scores(q[:, :, 4 * r : 4 * r + 4],
                                              k[:, :, 2 * r : 2 * r + 2], pos, 0.25).sum(1),
                             seq_lens, 32)
                for r in range(2)]

    def keep(chunks):
        # Candidates: chunks 1-6 of row 0, 1-5 of row 1 (blocks of 16 tokens).
        return select_blocks(chunks, torch.tensor([14, 12]), top_k_chunks=2, sink_blocks=2,
                             blocks_per_chunk=2, num_blocks=16)

    want = keep(chunk_scores(full.sum(1), seq_lens, 32))
    assert kept(want[0]) == [0, 1, 4, 5, 8, 9, 14, 15]
    assert kept(want[1]) == [0, 1, 4, 5, 8, 9, 12, 13, 14, 15]
    # A rank selecting from its own heads alone would keep other blocks.
    assert not torch.equal(keep(partials[0]), want)
    assert not torch.equal(keep(partials[1]), want)
    multiprocessing.spawn(_tensor_parallel_rank, args=(free_port(), partials, str(tmp_path)),
                          nprocs=2)
    for rank in range(2):
        summed = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(summed, partials[0] + partials[1])
        assert torch.equal(keep(summed), want)


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
