"""Model Runner V2's start-up order, driven through vLLM's own ``propose`` on
CPU (only its Triton kernels replaced by torch versions, the model forward by
a recorder): ``profile_run`` proposes a dummy batch *before*
``initialize_kv_cache`` calls ``set_attn`` (``determine_available_memory``
runs first), then CUDA graphs are captured, the warm-up proposes a dummy
batch with attention, and serving starts.

Mutation that fails it: ``MRV2Overrides.propose`` staging the draft's view
(``_activate``) on a dummy run before ``set_attn`` (the 00f0e89 code) raises
``AssertionError`` at the profile step, for all three speculators.
"""

import types

import pytest
import torch

from tests.common.test_engine_setup import engine_config
from tests.drafters.fakes import FakeAttention, input_batch
from tests.drafters.test_mrv2_eagle import (
    prepare_decode_inputs,
    prepare_prefill_inputs,
    update_draft_inputs,
)
from vllm_specextend.patches.drafter_instances import hook_attention_impls
from vllm_specextend.retrieval.kernels.selection import rewrite_block_table

K = 3
BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096
MAX_REQS = 4
STREAMING = {"mode": "streaming", "min_context_tokens": 1024, "sink_tokens": 32,
             "recent_tokens": 64, "chunk_size": 64, "top_k_chunks": 2}
TARGET_LAYER = "model.layers.3.self_attn.attn"
DRAFT_LAYER = "drafter.layers.0.self_attn.attn"




class GraphManager:
    """vLLM's ``SpeculatorCudaGraphManager`` as CPU sees it (mode NONE: every
    batch runs eagerly), recording what ``capture`` was handed."""

    use_breakable_cg = False

    def __init__(self, *args, **kwargs):
        self.captured = []

    def dispatch(self, num_reqs, num_tokens, *args, **kwargs):
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens,
                                        num_reqs=num_reqs)

    def capture(self, forward_fn, model_state, input_buffers, block_tables, *args, **kwargs):
        self.captured.append((input_buffers, block_tables))

    def specialize_spec_tokens(self, batch_desc, num_speculative_tokens):
        return batch_desc

    def run_fullgraph(self, batch_desc):
        raise AssertionError("mode NONE replays no graph")


def standalone_prepare_prefill_inputs(input_buffers, input_batch, last_sampled, num_rejected,
                                      expanded_input_ids, expanded_positions,
                                      last_token_indices, max_num_reqs, max_model_len):
    """``standalone_ar/speculator.py::prepare_prefill_inputs`` in torch: each
    row's query plus one correction slot, expanded in place."""
    num_reqs = input_batch.num_reqs
    qsl = input_batch.query_start_loc_np
    for i in range(num_reqs):
        start, end = int(qsl[i]), int(qsl[i + 1])
        out = start + i
        valid = end - start - int(num_rejected[i])
        expanded_input_ids[out: out + end - start] = input_batch.input_ids[start:end]
        expanded_input_ids[out + valid] = last_sampled[int(input_batch.idx_mapping[i])]
        first = int(input_batch.positions[start])
        expanded_positions[out: out + end - start + 1] = torch.arange(
            first, first + end - start + 1).clamp(max=max_model_len - 1)
        last_token_indices[i] = out + valid
        input_buffers.query_start_loc[i] = out
        input_buffers.seq_lens[i] = min(int(input_batch.seq_lens[i]) + 1, max_model_len)
    total = int(qsl[num_reqs]) + num_reqs
    input_buffers.query_start_loc[num_reqs:] = total
    input_buffers.seq_lens[num_reqs:] = 0
    last_token_indices[num_reqs:] = 0
    return total


def build(method, target_model, draft_model, monkeypatch):
    """Our MRV2 speculator for ``method`` as MRV2's ``load_model`` leaves it
    (draft layers attached, no KV cache yet); ``set_attn`` is left to the test."""
    from vllm.v1.worker.gpu.spec_decode import speculator as speculator_module
    from vllm.v1.worker.gpu.spec_decode.standalone_ar import speculator as standalone_module
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar import speculator as td_module

    from tests.eagle_heads import build_eagle_head
    from tests.tiny_models import TARGET_LLAMA, TARGET_QWEN2, build_mtp_target
    from vllm_specextend.drafters.mrv2_draft_model import SpecExtendStandaloneARSpeculator
    from vllm_specextend.drafters.mrv2_eagle import SpecExtendEagleSpeculator
    from vllm_specextend.drafters.mrv2_mtp import SpecExtendMTPSpeculator

    extra = dict(max_num_seqs=MAX_REQS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512)
    if method == "draft_model":
        config = engine_config(target_model, draft_model, spec_extend=STREAMING, **extra)
        cls = SpecExtendStandaloneARSpeculator
    elif method == "mtp":
        config = engine_config(build_mtp_target(TARGET_QWEN2), spec_extend=STREAMING,
                               speculative_config={"method": "mtp",
                                                   "num_speculative_tokens": K}, **extra)
        cls = SpecExtendMTPSpeculator
    else:
        head = str(build_eagle_head(TARGET_LLAMA, "eagle3"))
        config = engine_config(target_model, spec_extend=STREAMING,
                               speculative_config={"method": "eagle3", "model": head,
                                                   "num_speculative_tokens": K}, **extra)
        cls = SpecExtendEagleSpeculator
    spec = cls(config, torch.device("cpu"))
    # What MRV2's load_model leaves: the draft loaded, retrieval attached.
    spec.model = torch.nn.Module()
    spec.draft_attn_layer_names = {DRAFT_LAYER}
    spec.retrieval.attach({TARGET_LAYER: FakeAttention(), DRAFT_LAYER: FakeAttention()},
                          spec.draft_attn_layer_names)
    spec.forwards = []
    monkeypatch.setattr(speculator_module, "init_attn_backend",
                        lambda *args, **kwargs: ([], {}, None))
    monkeypatch.setattr(speculator_module, "build_attn_metadata", lambda **kwargs: {
        DRAFT_LAYER: types.SimpleNamespace(seq_lens=kwargs["seq_lens"].clone(),
                                           block_table=kwargs["block_tables"][0].clone())})
    spec.sample_draft = lambda hidden_states, *args: torch.full(
        (hidden_states.shape[0],), 7, dtype=torch.int64)

    def record(attn_metadata, num_tokens):
        layer = (attn_metadata or {}).get(DRAFT_LAYER)
        spec.forwards.append(None if layer is None else
                             {"seq_lens": layer.seq_lens, "block_table": layer.block_table})
        return torch.zeros(num_tokens, 8)

    if method == "draft_model":
        monkeypatch.setattr(standalone_module, "prepare_prefill_inputs",
                            standalone_prepare_prefill_inputs)
        monkeypatch.setattr(
            standalone_module.StandaloneARSpeculator, "_run_model",
            lambda self, input_ids, positions, attn_metadata, *args:
            record(attn_metadata, input_ids.shape[0]))
    else:
        for kernel in (prepare_prefill_inputs, prepare_decode_inputs, update_draft_inputs):
            monkeypatch.setattr(td_module, kernel.__name__, kernel)

        def run_model(self, num_tokens, attn_metadata, *args, **kwargs):
            hidden = record(attn_metadata, num_tokens)
            return hidden, hidden

        monkeypatch.setattr(td_module.TargetDependentARSpeculator, "_run_model", run_model)
        monkeypatch.setattr(td_module, "SpeculatorCudaGraphManager", GraphManager)
        monkeypatch.setattr(type(spec), "hidden_size", 8, raising=False)
        spec.hidden_states = torch.zeros(spec.max_num_tokens, 8)
    return spec


def set_attn(spec):
    """``initialize_kv_cache``'s call, over a per-request block table."""
    max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    block_tables = types.SimpleNamespace(
        num_kv_cache_groups=1,
        block_sizes=[BLOCK_SIZE],
        input_block_tables=[torch.arange(MAX_REQS * max_blocks, dtype=torch.int32)
                            .view(MAX_REQS, -1)],
        slot_mappings=torch.zeros(1, 1024, dtype=torch.int64),
        compute_slot_mappings=lambda *args, **kwargs: torch.zeros(1, 1024, dtype=torch.int64),
        cp_size=1,
    )
    kv_cache_config = types.SimpleNamespace(
        num_blocks=MAX_REQS * max_blocks,
        kv_cache_groups=[types.SimpleNamespace(layer_names=[TARGET_LAYER, DRAFT_LAYER])],
    )
    spec.set_attn(None, kv_cache_config, block_tables, None, None)
    hook_attention_impls(spec.retrieval)  # as the runner's KV cache set-up




def propose(spec, batch, num_rejected, dummy_run=False, skip_attn=False, is_profile=False):
    """MRV2's call (``_dummy_run`` / ``sample_tokens``), keywords as vLLM passes them."""
    num_reqs = batch.num_reqs
    return spec.propose(
        input_batch=batch,
        attn_metadata=None if skip_attn else {DRAFT_LAYER: types.SimpleNamespace(
            seq_lens=batch.seq_lens,
            block_table=spec.block_tables.input_block_tables[0][:num_reqs])},
        slot_mappings=None if skip_attn else {},
        last_hidden_states=torch.zeros(batch.num_tokens, 8),
        aux_hidden_states=None,
        num_sampled=torch.ones(num_reqs, dtype=torch.int32),
        num_rejected=num_rejected,
        last_sampled=torch.zeros(MAX_REQS, dtype=torch.int64),
        next_prefill_tokens=torch.zeros(MAX_REQS, dtype=torch.int32),
        temperature=torch.zeros(MAX_REQS),
        seeds=torch.zeros(MAX_REQS, dtype=torch.int64),
        dp_sync_state=None,
        dummy_run=dummy_run,
        skip_attn_for_dummy_run=skip_attn,
        mm_inputs=None,
        is_profile=is_profile,
    )


# A decode row at 3000 tokens (one draft rejected), the last prompt chunk of
# K + 1 tokens (not compacted) and a short decode row.
LONG_BATCH = dict(query_lens=[K + 1] * 3, context_lens=[3000, 2996, 500],
                  prompt_lens=[1000, 3000, 400])
NUM_REJECTED = torch.tensor([1, 0, 0])


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "mtp"])
def test_profile_capture_then_serving_in_model_runner_v2_order(method, target_model,
                                                               draft_model, monkeypatch):
    from vllm.config.compilation import CUDAGraphMode

    spec = build(method, target_model, draft_model, monkeypatch)
    # 1. profile_run (determine_available_memory): no KV cache, no set_attn yet.
    profile = input_batch(query_lens=[128] * MAX_REQS, context_lens=[0] * MAX_REQS,
                          prompt_lens=[128] * MAX_REQS)
    drafts = propose(spec, profile, torch.zeros(MAX_REQS, dtype=torch.int32),
                     dummy_run=True, skip_attn=True, is_profile=True)
    assert drafts.shape == (MAX_REQS, K)
    assert spec.forwards and all(f is None for f in spec.forwards)  # no attention
    # 2. initialize_kv_cache, then capture.
    set_attn(spec)
    spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    spec.capture()
    decode_graphs = getattr(spec, "decode_cudagraph_manager", None)
    if decode_graphs is not None:  # an EAGLE head / MTP layer: over the compacted buffers
        (input_buffers, block_tables), = decode_graphs.captured
        assert input_buffers.seq_lens is spec._compact_seq_lens
        assert block_tables.input_block_tables[0] is spec._compact_block_table
    # 3. The warm-up's dummy run with attention: the stock view.
    stock_table = spec.block_tables.input_block_tables[0]
    spec.forwards.clear()
    warm = input_batch(query_lens=[K + 1] * 2, context_lens=[3000, 2000],
                       prompt_lens=[100, 100])
    propose(spec, warm, torch.zeros(2, dtype=torch.int32), dummy_run=True)
    assert spec.forwards
    for forward in spec.forwards:
        assert torch.equal(forward["block_table"][:2], stock_table[:2])
    assert spec.retrieval.planner.stats.as_dict()["retrievals"] == 0
    # 4. Serving: every draft forward reads the compacted view of row 0.
    spec.forwards.clear()
    batch = input_batch(**LONG_BATCH)
    assert propose(spec, batch, NUM_REJECTED).tolist() == [[7] * K] * 3
    keep = torch.ones_like(stock_table, dtype=torch.bool)
    keep[0, 1:86] = False  # sink block 0, two 2-block chunks, the recent window
    keep[0, 90] = False
    compact_table, removed = rewrite_block_table(stock_table[:3], keep[:3], BLOCK_SIZE)
    assert removed.tolist() == [86 * BLOCK_SIZE, 0, 0]
    assert len(spec.forwards) == K
    for forward in spec.forwards:
        assert torch.equal(forward["block_table"][:3], compact_table)
        seq_lens = forward["seq_lens"][:3]
        assert (seq_lens[1:] >= batch.seq_lens[1:]).all()  # stock rows
        assert (seq_lens <= batch.seq_lens + K - removed).all()
    assert spec.retrieval.planner.stats.as_dict()["retrievals"] == 1


def test_k0_steps_plan_nothing_and_dummy_tables_hold_no_stale_blocks(target_model, draft_model,
                                                                    monkeypatch):
    """vLLM 0.33's ``skip_drafts`` steps propose with ``num_speculative_tokens=0``
    (the head only keeps its KV in sync): no retrieval is planned for them. A
    dummy block table for capture is all zeros beyond its rows too."""
    from vllm.config.compilation import CUDAGraphMode

    spec = build("eagle3", target_model, draft_model, monkeypatch)
    set_attn(spec)
    spec.init_cudagraph_manager(CUDAGraphMode.NONE)
    batch = input_batch(**LONG_BATCH)
    planned = []
    monkeypatch.setattr(spec.retrieval, "plan", lambda batch: planned.append(batch))
    propose_k0 = spec.propose
    monkeypatch.setattr(spec, "propose", lambda *args, **kwargs: propose_k0(
        *args, **kwargs, num_speculative_tokens=0))
    propose(spec, batch, NUM_REJECTED)
    assert planned == [], planned
    spec._compact_block_table.fill_(5)
    dummy, = spec._compacted_block_tables().get_dummy_block_tables(2)
    assert dummy.shape[0] == 2 and not spec._compact_block_table.any()


def test_layers_that_bypass_the_kv_update_are_refused_at_load(target_model, draft_model,
                                                              monkeypatch):
    from vllm_specextend.common.options import SpecExtendConfigError

    spec = build("draft_model", target_model, draft_model, monkeypatch)
    fused = FakeAttention()
    fused.kv_cache_update_bypass = True  # vLLM 0.33: the model writes its KV itself
    with pytest.raises(SpecExtendConfigError, match=r"kv_cache_update_bypass: \['"
                                                    + TARGET_LAYER):
        spec.retrieval.attach({TARGET_LAYER: fused, DRAFT_LAYER: FakeAttention()},
                              spec.draft_attn_layer_names)
