"""Model Runner V2's target-dependent speculators (EAGLE heads, MTP layers) with
retrieval, run through vLLM's own ``TargetDependentARSpeculator.propose`` on
CPU: its Triton kernels are replaced by torch versions of what they compute,
the head's forward by a recorder of what its attention would read. MRV2 needs
CUDA: the engine test skips on CPU."""

import types

import pytest
import torch

from tests.common.test_engine_setup import engine_config
from tests.drafters.fakes import FakeAttention, input_batch
from tests.drafters.test_mrv2_draft_model import BLOCK_SIZE, simulate_gpu
from tests.engine_utils import run_engine
from vllm_specextend.patches.drafter_instances import (
    hook_attention_impls,
    route_cudagraph_managers,
)
from vllm_specextend.retrieval.kernels.selection import rewrite_block_table

K = 3
MAX_MODEL_LEN = 4096
STREAMING = {"mode": "streaming", "min_context_tokens": 1024, "sink_tokens": 32,
             "recent_tokens": 64, "chunk_size": 64, "top_k_chunks": 2}
TARGET_LAYER = "model.layers.3.self_attn.attn"
HEAD_LAYER = "model.layers.4.self_attn.attn"


# ---- torch versions of the speculator's Triton kernels ----------------------
# (vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py)


def prepare_prefill_inputs(last_token_indices, current_draft_step, input_buffers, input_batch,
                           num_sampled, num_rejected, last_sampled, next_prefill_tokens,
                           max_num_reqs):
    num_reqs = input_batch.num_reqs
    qsl = input_batch.query_start_loc.tolist()
    for i in range(num_reqs):
        start, length = qsl[i], qsl[i + 1] - qsl[i] - int(num_rejected[i])
        state = int(input_batch.idx_mapping[i])
        next_token = last_sampled[state] if num_sampled[i] > 0 else next_prefill_tokens[state]
        ids = input_buffers.input_ids
        ids[start: start + length - 1] = input_batch.input_ids[start + 1: start + length]
        ids[start + length - 1] = next_token
        last_token_indices[i] = start + length - 1
        input_buffers.positions[start: start + length] = \
            input_batch.positions[start: start + length]
        input_buffers.query_start_loc[i] = start
        input_buffers.seq_lens[i] = input_batch.seq_lens[i]
    current_draft_step.fill_(0)
    input_buffers.query_start_loc[num_reqs:] = qsl[num_reqs]
    input_buffers.seq_lens[num_reqs:] = 0
    last_token_indices[num_reqs:] = 0
    return last_token_indices


def prepare_decode_inputs(draft_tokens, target_seq_lens, num_rejected, input_buffers,
                          sample_src_positions, max_model_len, max_num_reqs,
                          advance_draft_positions=True):
    num_reqs = draft_tokens.shape[0]
    input_buffers.query_start_loc[:] = torch.arange(max_num_reqs + 1).clamp(max=num_reqs)
    input_buffers.seq_lens[num_reqs:] = 0
    input_buffers.input_ids[:num_reqs] = draft_tokens
    sample_src_positions[:num_reqs] += 1
    seq_lens = target_seq_lens[:num_reqs] - num_rejected[:num_reqs]
    if advance_draft_positions:
        positions = input_buffers.positions[:num_reqs]
        positions.copy_((positions + 1).clamp(max=max_model_len - 1))
        seq_lens = (seq_lens + 1).clamp(max=max_model_len)
    input_buffers.seq_lens[:num_reqs] = seq_lens


def update_draft_inputs(draft_tokens, current_draft_step, hidden_states, output_draft_tokens,
                        next_input_hidden_states, input_buffers, sample_src_positions,
                        num_reqs, max_model_len, num_speculative_steps,
                        advance_draft_positions=True):
    step = int(current_draft_step)
    output_draft_tokens[:num_reqs, step] = draft_tokens
    if step >= num_speculative_steps - 1:
        return
    sample_src_positions[:num_reqs] += 1
    input_buffers.input_ids[:num_reqs] = draft_tokens
    next_input_hidden_states[:num_reqs] = hidden_states[:num_reqs]
    if advance_draft_positions:
        positions = input_buffers.positions[:num_reqs]
        positions.copy_((positions + 1).clamp(max=max_model_len - 1))
        seq_lens = input_buffers.seq_lens[:num_reqs]
        seq_lens.copy_((seq_lens + 1).clamp(max=max_model_len))


# ---- the speculator ------------------------------------------------------------


def build_speculator(method, monkeypatch, draft_window=None):
    """Our speculator for ``method`` on CPU, attached like MRV2's runner does,
    with vLLM's attention backends replaced (they need the real layers),
    metadata builds that hand back the tensors they were given, and a head
    forward that records what its attention and rotary embedding would read."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.gpu.spec_decode import speculator as speculator_module
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar import speculator as td_module

    from tests.eagle_heads import build_eagle_head
    from tests.tiny_models import TARGET_LLAMA, TARGET_QWEN2, build_model, build_mtp_target
    from vllm_specextend.drafters.mrv2_eagle import SpecExtendEagleSpeculator
    from vllm_specextend.drafters.mrv2_mtp import SpecExtendMTPSpeculator

    if method == "mtp":
        target, speculative = build_mtp_target(TARGET_QWEN2), {"method": "mtp"}
        cls = SpecExtendMTPSpeculator
    else:
        target = build_model(TARGET_LLAMA)
        speculative = {"method": "eagle3", "model": str(build_eagle_head(TARGET_LLAMA, "eagle3"))}
        cls = SpecExtendEagleSpeculator
    if draft_window is not None:
        speculative["max_model_len"] = draft_window
    config = engine_config(target, spec_extend=STREAMING, max_num_seqs=4,
                           max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512,
                           speculative_config={**speculative, "num_speculative_tokens": K})
    spec = cls(config, torch.device("cpu"))
    spec.draft_attn_layer_names = {HEAD_LAYER}  # what MRV2's load_model sets
    head_layer = FakeAttention()
    head_layer.kv_cache = torch.zeros(1)
    spec.retrieval.attach({TARGET_LAYER: FakeAttention(), HEAD_LAYER: head_layer},
                          spec.draft_attn_layer_names)
    monkeypatch.setattr(speculator_module, "init_attn_backend",
                        lambda *args, **kwargs: ([], {}, None))
    monkeypatch.setattr(speculator_module, "build_attn_metadata", lambda **kwargs: {
        HEAD_LAYER: types.SimpleNamespace(seq_lens=kwargs["seq_lens"],
                                          block_table=kwargs["block_tables"][0])})
    for kernel in (prepare_prefill_inputs, prepare_decode_inputs, update_draft_inputs):
        monkeypatch.setattr(td_module, kernel.__name__, kernel)
    max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    block_tables = types.SimpleNamespace(
        num_kv_cache_groups=1,
        block_sizes=[BLOCK_SIZE],
        input_block_tables=[torch.arange(4 * max_blocks, dtype=torch.int32).view(4, -1)],
        slot_mappings=torch.zeros(1, 64, dtype=torch.int64),
        compute_slot_mappings=lambda *args, **kwargs: torch.zeros(1, 64, dtype=torch.int64),
        cp_size=1,
    )
    kv_cache_config = types.SimpleNamespace(
        num_blocks=4 * max_blocks,
        kv_cache_groups=[types.SimpleNamespace(layer_names=[TARGET_LAYER, HEAD_LAYER])],
    )
    # The head's rotary embedding (read for the plain KV copy of compact positions).
    with set_current_vllm_config(config):
        spec.model = torch.nn.ModuleDict({"rotary_emb": get_rope(FakeAttention.head_size, MAX_MODEL_LEN)})
    spec.set_attn(None, kv_cache_config, block_tables, None, None)
    hook_attention_impls(spec.retrieval)  # as the runner's KV cache set-up
    spec.sample_draft = lambda hidden_states, *args: torch.full(
        (hidden_states.shape[0],), 7, dtype=torch.int64)
    spec.forwards = []

    def run_model(self, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp,
                  cudagraph_runtime_mode=None, mm_inputs=None):
        head = attn_metadata[HEAD_LAYER]
        self.forwards.append({"step": int(self.current_draft_step),
                              "seq_lens": head.seq_lens.clone(),
                              "block_table": head.block_table.clone(),
                              "positions": self.input_buffers.positions[:num_tokens].clone(),
                              # MRV2's own buffer (slot mappings, sampling keys).
                              "stock_positions": getattr(self.input_buffers, "_base",
                                                         self.input_buffers)
                              .positions[:num_tokens].clone()})
        hidden = torch.zeros(num_tokens, self.hidden_size)
        return hidden, hidden

    monkeypatch.setattr(td_module.TargetDependentARSpeculator, "_run_model", run_model)
    return spec


@pytest.fixture(params=["eagle3", "mtp"])
def speculator(request, monkeypatch):
    return build_speculator(request.param, monkeypatch)




def propose(spec, batch, num_rejected, dummy_run=False):
    num_reqs, max_reqs = batch.num_reqs, spec.max_num_reqs
    hidden = torch.zeros(batch.num_tokens, spec.hidden_size)
    target_metadata = {HEAD_LAYER: types.SimpleNamespace(
        seq_lens=batch.seq_lens, block_table=spec.block_tables.input_block_tables[0][:num_reqs])}
    return spec.propose(
        batch, target_metadata, {}, hidden, None,
        torch.ones(num_reqs, dtype=torch.int32), num_rejected,
        torch.zeros(max_reqs, dtype=torch.int64), torch.zeros(max_reqs, dtype=torch.int32),
        torch.zeros(max_reqs), torch.zeros(max_reqs, dtype=torch.int64),
        dummy_run=dummy_run, is_profile=True,
    )


# A decode row at 3000 tokens (one draft rejected), a last prompt chunk of
# K + 1 tokens, and a short decode row.
LONG_BATCH = dict(query_lens=[K + 1, K + 1, K + 1], context_lens=[3000, 2996, 500],
                  prompt_lens=[1000, 3000, 400])
NUM_REJECTED = torch.tensor([1, 0, 0])


def expected_view(spec):
    table = spec.block_tables.input_block_tables[0]
    keep = torch.ones_like(table, dtype=torch.bool)
    # Row 0: sink block 0, the top 2 chunks (2 blocks each) ending before the
    # recent window, the window itself (blocks 91 on).
    keep[0, 1:86] = False
    keep[0, 90] = False
    compact_table, removed = rewrite_block_table(table[:3], keep[:3], BLOCK_SIZE)
    assert removed.tolist() == [86 * BLOCK_SIZE, 0, 0]
    return compact_table, removed


@pytest.mark.parametrize("fused", [True, False], ids=["fused-update", "rebuilt"])
def test_every_forward_of_the_head_reads_the_compacted_view(speculator, fused):
    assert speculator.supports_decode_metadata_update  # vLLM's default: no backend refuses
    speculator.supports_decode_metadata_update = fused
    batch = input_batch(**LONG_BATCH)
    drafts = propose(speculator, batch, NUM_REJECTED)
    assert drafts.tolist() == [[7] * K] * 3
    compact_table, removed = expected_view(speculator)
    forwards = speculator.forwards
    assert [f["step"] for f in forwards] == list(range(K))
    # Step 0 over the target's batch; step s reads the accepted tokens, the
    # correction token and s drafts.
    for step, forward in enumerate(forwards):
        stock = batch.seq_lens if step == 0 else batch.seq_lens - NUM_REJECTED + step
        assert forward["seq_lens"][:3].tolist() == (stock - removed).tolist()
        assert torch.equal(forward["block_table"][:3], compact_table)
    figures = speculator.retrieval.planner.stats.as_dict()
    assert figures["retrievals"] == 1
    # The speculator's own buffers keep the stock lengths.
    assert speculator.input_buffers.seq_lens[:3].tolist() == \
        (batch.seq_lens - NUM_REJECTED + K - 1).tolist()


def test_fused_update_without_the_refresh_would_read_stale_lengths(speculator, monkeypatch):
    """The failure the refresh prevents: vLLM's fused path updates metadata in
    place, so the compacted lengths built at step 1 would stay there."""
    from vllm_specextend.drafters.mrv2_overrides import MRV2Overrides

    monkeypatch.setattr(MRV2Overrides, "_update_draft_decode_metadata", lambda self, md, n:
                        super(MRV2Overrides, self)._update_draft_decode_metadata(md, n))
    propose(speculator, input_batch(**LONG_BATCH), NUM_REJECTED)
    step1, step2 = (f["seq_lens"][0].item() for f in speculator.forwards[1:])
    assert step1 == step2  # stale: step 2 reads step 1's length


def test_short_batches_and_dummy_runs_read_the_stock_view(speculator):
    table = speculator.block_tables.input_block_tables[0]
    short = input_batch(query_lens=[K + 1], context_lens=[500], prompt_lens=[400])
    long = input_batch(query_lens=[K + 1], context_lens=[3000], prompt_lens=[1000])
    for batch, dummy_run in ((short, False), (long, True)):
        speculator.forwards.clear()
        propose(speculator, batch, torch.zeros(1, dtype=torch.int64), dummy_run)
        first = speculator.forwards[0]
        assert first["seq_lens"][0] == batch.seq_lens[0]
        assert all(torch.equal(f["block_table"][:1], table[:1])
                   for f in speculator.forwards[1:])


def test_cuda_graphs_see_the_compacted_buffers(speculator):
    """Decode graphs are captured over the persistent compacted buffers; a
    compacted step does not replay the step-0 graph (it bakes the target's
    metadata) but runs step 0 eagerly over the compacted view."""
    captured, replays = {}, []

    def capture(forward_fn, model_state, input_buffers, block_tables, *args, **kwargs):
        captured["seq_lens"] = input_buffers.seq_lens
        captured["tables"] = block_tables.get_dummy_block_tables(4)

    speculator.prefill_cudagraph_manager = types.SimpleNamespace(run_fullgraph=replays.append)
    speculator.decode_cudagraph_manager = types.SimpleNamespace(
        capture=capture, specialize_spec_tokens=lambda desc, num_speculative_tokens: desc)
    route_cudagraph_managers(speculator)  # as init_cudagraph_manager's patch
    speculator.decode_cudagraph_manager.capture(None, None, speculator.input_buffers,
                                                speculator.block_tables)
    assert captured["seq_lens"] is speculator._compact_seq_lens
    assert captured["tables"][0].data_ptr() == speculator._compact_block_table.data_ptr()

    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar import speculator as td_module

    def full_step0(manager, num_reqs, num_tokens, *args, **kwargs):
        mode = CUDAGraphMode.FULL if manager is speculator.prefill_cudagraph_manager \
            else CUDAGraphMode.NONE
        return BatchExecutionDescriptor(cg_mode=mode, num_tokens=num_tokens,
                                        num_reqs=num_reqs), None

    stock_dispatch = td_module.dispatch_cg_and_sync_dp
    td_module.dispatch_cg_and_sync_dp = full_step0
    try:
        short = input_batch(query_lens=[K + 1], context_lens=[500], prompt_lens=[400])
        propose(speculator, short, torch.zeros(1, dtype=torch.int64))
        assert len(replays) == 1  # nothing compacted: the graph replays
        speculator.forwards.clear()
        batch = input_batch(**LONG_BATCH)
        propose(speculator, batch, NUM_REJECTED)
    finally:
        td_module.dispatch_cg_and_sync_dp = stock_dispatch
    assert len(replays) == 1
    compact_table, removed = expected_view(speculator)
    step0 = speculator.forwards[0]
    assert step0["step"] == 0
    assert step0["seq_lens"][:3].tolist() == (batch.seq_lens - removed).tolist()
    assert torch.equal(step0["block_table"][:3], compact_table)


def test_heads_in_model_runner_v2_get_our_speculators(target_model, monkeypatch):
    from tests.common.test_engine_setup import eagle_config
    from tests.tiny_models import TARGET_QWEN2, build_mtp_target
    from vllm_specextend.drafters.mrv2_eagle import SpecExtendEagleSpeculator
    from vllm_specextend.drafters.mrv2_mtp import SpecExtendMTPSpeculator
    from vllm_specextend.patches.model_runners import patch_model_runner_v2_init

    module = types.ModuleType("model_runner_v2")
    module.init_speculator = lambda vllm_config, device, req_states: "stock speculator"

    class GPUModelRunner:
        def __init__(self, vllm_config, device):
            self.speculator = module.init_speculator(vllm_config, device, None)

    module.GPUModelRunner = GPUModelRunner
    patch_model_runner_v2_init(module)
    simulate_gpu(monkeypatch, v2_env=True)
    head = eagle_config(target_model, "eagle3")
    mtp = engine_config(build_mtp_target(TARGET_QWEN2), spec_extend={},
                        speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    cpu = torch.device("cpu")
    for config, speculator in ((head, SpecExtendEagleSpeculator), (mtp, SpecExtendMTPSpeculator)):
        assert config.use_v2_model_runner
        built = GPUModelRunner(config, cpu).speculator
        assert type(built) is speculator
        assert built.retrieval.setup.method == config.speculative_config.method


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Model Runner V2's kernels need CUDA (Triton)")
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_runner_v2_engine_with_a_head_is_lossless_and_retrieves(method, monkeypatch):
    from tests.engine.test_engine_eagle import drafting
    from tests.engine_utils import corpus_prompts

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    target, base, head, _ = drafting(method)
    prompts = corpus_prompts(target, [3000, 2500])
    reference = run_engine(base, prompts, max_tokens=48)
    ours = run_engine(target, prompts, max_tokens=48, draft=head, method=method, k=K,
                      spec_extend=STREAMING)
    assert ours.token_ids == reference.token_ids
    assert ours.retrieval["retrievals"] > 0


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_compact_positions_keep_the_head_inside_its_window(method, monkeypatch):
    """A head with a 1024-position window on 3000-token rows: each forward runs
    at original position minus its row's removed tokens, inside the window,
    while MRV2's own position buffer (slot mappings) keeps the originals."""
    window = 1024
    speculator = build_speculator(method, monkeypatch, draft_window=window)
    assert speculator.retrieval.compact_positions
    batch = input_batch(**LONG_BATCH)
    propose(speculator, batch, NUM_REJECTED)
    removed = speculator._removed_tokens[:3].long()
    assert removed[0] > 0 and removed[1] > 0 and removed[2] == 0
    query_lens = torch.tensor(LONG_BATCH["query_lens"])
    for forward in speculator.forwards:
        stock = forward["stock_positions"]
        if forward["step"] == 0:
            # Real tokens only: the rejected draft's slot carries no position.
            rows = torch.repeat_interleave(torch.arange(3), query_lens)
            real = torch.arange(len(rows)) != K  # row 0's rejected slot
            assert torch.equal(stock[real], batch.positions[real])
        else:
            rows, real = torch.arange(3), torch.ones(3, dtype=torch.bool)
        expected = stock - removed[rows]
        assert torch.equal(forward["positions"][real], expected[real])
        assert 0 <= expected[real].min() and expected[real].max() < window
    # The last decode step ran at the original last accepted position + K - 1.
    last = speculator.forwards[-1]["stock_positions"]
    assert last.tolist() == [3002 + K - 1, 2999 + K - 1, 503 + K - 1]
