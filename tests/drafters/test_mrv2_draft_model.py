"""Model Runner V2 (vLLM's default GPU runner): which runner an engine gets,
and the MRV2 seam (``SpecExtendStandaloneARSpeculator``) run through vLLM's own
``StandaloneARSpeculator.propose`` on CPU, its Triton kernel replaced by a torch
version. MRV2's kernels need CUDA: the engine test skips on CPU."""

import types

import pytest
import torch

from tests.common.test_engine_setup import capped_draft, engine_config
from tests.drafters.fakes import FakeAttention, input_batch
from tests.engine_utils import run_engine
from vllm_specextend.patches.drafter_instances import hook_attention_impls
from vllm_specextend.retrieval.kernels.selection import rewrite_block_table

K = 3
BLOCK_SIZE = 32
STREAMING = {"mode": "streaming", "min_context_tokens": 1024, "sink_tokens": 32,
             "recent_tokens": 64, "chunk_size": 64, "top_k_chunks": 2}


def simulate_gpu(monkeypatch, v2_env):
    """vLLM's GPU choice: MRV2 whenever Triton works, unless the env says."""
    import vllm.envs
    from vllm.config import VllmConfig
    from vllm.config import vllm as vllm_config_module

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setattr(VllmConfig, "_get_v2_model_runner_unsupported_features",
                        lambda self: [])
    monkeypatch.setattr(vllm.envs, "VLLM_USE_V2_MODEL_RUNNER", v2_env, raising=False)


def test_default_gpu_setup_runs_retrieval_in_the_v1_runner(target_model, draft_model, monkeypatch):
    stock = engine_config(target_model, draft_model)
    ours = engine_config(target_model, draft_model, spec_extend={})
    simulate_gpu(monkeypatch, v2_env=None)
    assert stock.use_v2_model_runner  # vLLM's GPU default, untouched
    assert not ours.use_v2_model_runner
    # mode "off" is stock drafting: vLLM's choice stands.
    assert engine_config(target_model, draft_model, spec_extend={"mode": "off"}).use_v2_model_runner


def test_explicit_choices_are_kept(target_model, draft_model, monkeypatch):
    from vllm_specextend.common.engine_setup import resolve_setup

    ours = engine_config(target_model, draft_model, spec_extend={})
    capped = engine_config(target_model, spec_extend={},
                           speculative_config=capped_draft(1024)(draft_model))
    simulate_gpu(monkeypatch, v2_env=False)
    assert not ours.use_v2_model_runner
    simulate_gpu(monkeypatch, v2_env=True)
    assert ours.use_v2_model_runner
    assert resolve_setup(ours) is not None  # the MRV2 adapter takes it
    assert capped.use_v2_model_runner
    assert resolve_setup(capped).compact_positions


def test_runner_v2_builds_our_speculator_then_restores_vllms(target_model, draft_model):
    from vllm_specextend.drafters.mrv2_draft_model import SpecExtendStandaloneARSpeculator
    from vllm_specextend.patches.model_runners import patch_model_runner_v2_init

    module = types.ModuleType("model_runner_v2")
    module.init_speculator = lambda vllm_config, device, req_states: "stock speculator"

    class GPUModelRunner:
        def __init__(self, vllm_config, device):
            self.speculator = module.init_speculator(vllm_config, device, None)

    module.GPUModelRunner = GPUModelRunner
    patch_model_runner_v2_init(module)
    cpu = torch.device("cpu")
    ours = GPUModelRunner(engine_config(target_model, draft_model, spec_extend={}), cpu)
    assert isinstance(ours.speculator, SpecExtendStandaloneARSpeculator)
    stock = GPUModelRunner(engine_config(target_model, draft_model), cpu)
    assert stock.speculator == "stock speculator"
    # vLLM's own MRV2 runner module is wrapped once it is imported.
    import vllm.v1.worker.gpu.model_runner as model_runner_v2

    assert getattr(model_runner_v2.GPUModelRunner.__init__, "_specextend_wrapped", False)




TARGET_LAYER = "model.layers.1.self_attn.attn"
DRAFT_LAYER = "draft_model.model.layers.0.self_attn.attn"


@pytest.fixture
def speculator(target_model, draft_model, monkeypatch):
    """A ``SpecExtendStandaloneARSpeculator`` on CPU, attached like MRV2's runner does,
    with vLLM's attention backends replaced (they need the real layers)."""
    from vllm.v1.worker.gpu.spec_decode import speculator as speculator_module

    from vllm_specextend.drafters.mrv2_draft_model import SpecExtendStandaloneARSpeculator

    config = engine_config(target_model, draft_model, spec_extend=STREAMING,
                           max_num_seqs=4, max_model_len=4096)
    spec = SpecExtendStandaloneARSpeculator(config, torch.device("cpu"))
    spec.draft_attn_layer_names = {DRAFT_LAYER}  # what MRV2's load_model sets
    spec.retrieval.attach({TARGET_LAYER: FakeAttention(), DRAFT_LAYER: FakeAttention()},
                          spec.draft_attn_layer_names)
    monkeypatch.setattr(speculator_module, "init_attn_backend",
                        lambda *args, **kwargs: ([], {}, None))
    max_blocks = 4096 // BLOCK_SIZE
    block_tables = types.SimpleNamespace(
        num_kv_cache_groups=1,
        block_sizes=[BLOCK_SIZE],
        input_block_tables=[torch.arange(4 * max_blocks, dtype=torch.int32).view(4, -1)],
        slot_mappings=torch.zeros(1, 64, dtype=torch.int64),
        # Slot mappings (KV writes) stay stock: not what these tests look at.
        compute_slot_mappings=lambda *args, **kwargs: torch.zeros(1, 64, dtype=torch.int64),
        cp_size=1,
    )
    kv_cache_config = types.SimpleNamespace(
        num_blocks=4 * max_blocks,
        kv_cache_groups=[types.SimpleNamespace(layer_names=[TARGET_LAYER, DRAFT_LAYER])],
    )
    spec.set_attn(None, kv_cache_config, block_tables, None, None)
    hook_attention_impls(spec.retrieval)  # as the runner's KV cache set-up
    return spec




def prepare_prefill_inputs(input_buffers, input_batch, last_sampled, num_rejected,
                           expanded_input_ids, expanded_positions, last_token_indices,
                           max_num_reqs, max_model_len):
    """A torch version of the standalone speculator's step-0 Triton kernel
    (vllm/v1/worker/gpu/spec_decode/standalone_ar/speculator.py): each row's
    accepted tokens, its correction token, then its rejected slots."""
    num_reqs = input_batch.num_reqs
    qsl = input_batch.query_start_loc.tolist()
    for i in range(num_reqs):
        start, query_len = qsl[i], qsl[i + 1] - qsl[i]
        num_valid = query_len - int(num_rejected[i])
        out = start + i
        expanded_input_ids[out: out + query_len + 1] = 0
        expanded_input_ids[out: out + num_valid] = input_batch.input_ids[start: start + num_valid]
        expanded_input_ids[out + num_valid] = last_sampled[int(input_batch.idx_mapping[i])]
        positions = input_batch.positions[start] + torch.arange(query_len + 1)
        expanded_positions[out: out + query_len + 1] = positions.clamp(max=max_model_len - 1)
        last_token_indices[i] = out + num_valid
        input_buffers.query_start_loc[i] = out
        input_buffers.seq_lens[i] = min(int(input_batch.seq_lens[i]) + 1, max_model_len)
    total = qsl[num_reqs] + num_reqs
    input_buffers.query_start_loc[num_reqs:] = total
    input_buffers.seq_lens[num_reqs:] = 0
    last_token_indices[num_reqs:] = 0
    return total


def propose_through_vllm(spec, monkeypatch, batch, num_rejected, dummy_run=False):
    """Run vLLM's own ``StandaloneARSpeculator.propose`` (``_prefill``, then
    ``_multi_step_decode``) under our ``propose``, its Triton kernel replaced
    by a torch version, the draft's forward by a recorder of its positions and
    draft sampling by a constant; return what each attention metadata build
    handed vLLM's ``build_attn_metadata`` and the forwards."""
    from vllm.v1.worker.gpu.spec_decode import speculator as speculator_module
    from vllm.v1.worker.gpu.spec_decode.standalone_ar import speculator as standalone_module

    builds, forwards = [], []

    def build_attn_metadata(**kwargs):
        builds.append({"seq_lens": kwargs["seq_lens"].clone(),
                       "block_table": kwargs["block_tables"][0].clone()})
        return {}

    def run_model(self, input_ids, positions, *args):
        forwards.append(positions.clone())
        return torch.zeros(input_ids.shape[0], self.hidden_size)

    monkeypatch.setattr(speculator_module, "build_attn_metadata", build_attn_metadata)
    monkeypatch.setattr(standalone_module, "prepare_prefill_inputs", prepare_prefill_inputs)
    monkeypatch.setattr(standalone_module.StandaloneARSpeculator, "_run_model", run_model)
    monkeypatch.setattr(spec, "sample_draft", lambda hidden_states, *args: torch.full(
        (hidden_states.shape[0],), 7, dtype=torch.int64), raising=False)
    if getattr(spec, "model", None) is None:
        spec.model = torch.nn.Identity()  # what MRV2's load_model sets (read: not None)
    stock_buffers = spec.input_buffers
    max_reqs = spec.max_num_reqs
    drafts = spec.propose(batch, {}, {}, None, None, torch.ones(batch.num_reqs), num_rejected,
                          torch.full((max_reqs,), 5, dtype=torch.int64),
                          torch.zeros(max_reqs, dtype=torch.int64), torch.zeros(max_reqs),
                          torch.zeros(max_reqs, dtype=torch.int64), dummy_run=dummy_run)
    assert drafts.tolist() == [[7] * K] * batch.num_reqs
    assert len(forwards) == K  # step 0, then K - 1 decode steps
    assert spec.input_buffers is stock_buffers and spec._draft_view is None
    return builds


def test_propose_hands_the_compacted_view_to_every_draft_build(speculator, monkeypatch):
    """vLLM's own drafting loop reads the compacted view at every build.
    Mutations that fail it: ``MRV2Overrides._activate`` not writing the view's
    block table (the draft reads the whole context); ``_build_attn_metadata``
    not refreshing the compacted lengths (the decode steps read step 0's)."""
    # A decode row at 3000 tokens (one draft rejected), a last prompt chunk of
    # K + 1 tokens, and a short decode row.
    batch = input_batch(query_lens=[K + 1, K + 1, K + 1], context_lens=[3000, 2996, 500],
                        prompt_lens=[1000, 3000, 400])
    num_rejected = torch.tensor([1, 0, 0])
    builds = propose_through_vllm(speculator, monkeypatch, batch, num_rejected)

    table = speculator.block_tables.input_block_tables[0]
    keep = torch.ones_like(table, dtype=torch.bool)
    # Row 0: sink block 0, the top 2 chunks ending before the recent window
    # (block (3000 - 64) // 32 = 91 on): blocks 86-89; the window itself.
    keep[0, 1:86] = False
    keep[0, 90] = False
    expected_table, removed = rewrite_block_table(table[:3], keep[:3], BLOCK_SIZE)
    assert removed.tolist() == [86 * BLOCK_SIZE, 0, 0]
    # Step 0 reads the expanded query (+1 correction token); decode step s
    # the accepted tokens, the correction token and s drafts.
    expected_seq_lens = [batch.seq_lens + 1] + [batch.seq_lens - num_rejected + 1 + step
                                                for step in range(1, K)]
    assert len(builds) == K
    for build, seq_lens in zip(builds, expected_seq_lens):
        assert torch.equal(build["block_table"], expected_table)
        assert torch.equal(build["seq_lens"], seq_lens - removed)
    figures = speculator.retrieval.planner.stats.as_dict()
    assert figures["retrievals"] == 1
    # Tokens gained at the verification: K + 1 minus the rejected draft.
    assert figures["mean_acceptance_length"] == K
    # MRV2's own buffers keep the stock lengths.
    assert torch.equal(speculator.input_buffers.seq_lens[:3], expected_seq_lens[-1])


def test_dummy_runs_and_short_batches_draft_stock(speculator, monkeypatch):
    table = speculator.block_tables.input_block_tables[0]
    short = input_batch(query_lens=[K + 1], context_lens=[500], prompt_lens=[400])
    long = input_batch(query_lens=[K + 1], context_lens=[3000], prompt_lens=[1000])
    for batch, dummy_run in ((short, False), (long, True)):
        builds = propose_through_vllm(speculator, monkeypatch, batch,
                                      torch.zeros(1, dtype=torch.int64), dummy_run)
        assert len(builds) == K
        assert all(torch.equal(b["block_table"], table[:1]) for b in builds)
        assert builds[0]["seq_lens"][0] == batch.seq_lens[0] + 1


def test_compact_positions_shift_each_token_by_its_row(target_model, draft_model, monkeypatch):
    """A 1024-position draft: every draft forward (step 0's expanded rows,
    then one token per row) runs at original position minus its row's
    removed tokens, rows read from the draft's query start locations."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.gpu.spec_decode import speculator as speculator_module
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import (
        StandaloneARSpeculator,
    )

    from tests.common.test_engine_setup import capped_draft
    from vllm_specextend.drafters.mrv2_draft_model import SpecExtendStandaloneARSpeculator

    config = engine_config(target_model, spec_extend=STREAMING, max_num_seqs=4,
                           max_model_len=4096, max_num_batched_tokens=512,
                           speculative_config=capped_draft(1024)(draft_model))
    spec = SpecExtendStandaloneARSpeculator(config, torch.device("cpu"))
    spec.draft_attn_layer_names = {DRAFT_LAYER}
    draft_layer = FakeAttention()
    draft_layer.kv_cache = torch.zeros(1)
    spec.retrieval.attach({TARGET_LAYER: FakeAttention(), DRAFT_LAYER: draft_layer},
                          spec.draft_attn_layer_names)
    monkeypatch.setattr(speculator_module, "init_attn_backend",
                        lambda *args, **kwargs: ([], {}, None))
    with set_current_vllm_config(config):
        spec.model = torch.nn.ModuleDict({"rotary": get_rope(FakeAttention.head_size, 4096)})
    block_tables = types.SimpleNamespace(
        num_kv_cache_groups=1, block_sizes=[BLOCK_SIZE],
        input_block_tables=[torch.zeros(4, 4096 // BLOCK_SIZE, dtype=torch.int32)])
    kv_cache_config = types.SimpleNamespace(
        num_blocks=512,
        kv_cache_groups=[types.SimpleNamespace(layer_names=[TARGET_LAYER, DRAFT_LAYER])])
    spec.set_attn(None, kv_cache_config, block_tables, None, None)
    hook_attention_impls(spec.retrieval)  # as the runner's KV cache set-up
    assert spec.retrieval.compact_positions
    seen = []
    monkeypatch.setattr(StandaloneARSpeculator, "_run_model",
                        lambda self, input_ids, positions, *args: seen.append(positions.clone()))
    spec._removed_tokens[:2] = torch.tensor([2000, 0])
    spec._num_rows = 2
    # Step 0: K + 1 tokens and the correction token per row.
    spec.input_buffers.query_start_loc[:3] = torch.tensor([0, 5, 10])
    spec._run_model(torch.zeros(10), torch.cat((torch.arange(3000, 3005),
                                                torch.arange(500, 505))), None, None, None)
    # A decode step: one token per row.
    spec.input_buffers.query_start_loc[:3] = torch.tensor([0, 1, 2])
    spec._run_model(torch.zeros(2), torch.tensor([3005, 505]), None, None, None)
    assert seen[0].tolist() == list(range(1000, 1005)) + list(range(500, 505))
    assert seen[1].tolist() == [1005, 505]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Model Runner V2's kernels need CUDA (Triton)")
def test_runner_v2_engine_is_lossless_and_retrieves(target_model, draft_model, monkeypatch):
    from tests.engine_utils import corpus_prompts

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    prompts = corpus_prompts(target_model, [3000, 2500])
    target = run_engine(target_model, prompts, max_tokens=48)
    ours = run_engine(target_model, prompts, max_tokens=48, draft=draft_model, k=K,
                      spec_extend=STREAMING)
    assert ours.token_ids == target.token_ids
    assert ours.retrieval["retrievals"] > 0
