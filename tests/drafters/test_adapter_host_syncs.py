"""No host syncs in the adapters' per-step paths, proven without a GPU.

The V1 proposer's overrides (``drafters/v1_overrides.py``: planning, goodput
control's pauses and catch-up, the kept hidden states of a head, compact
positions and the draft's metadata) run over a stand-in for vLLM's
``SpecDecodeBaseProposer`` (its ``propose`` makes the calls the stock one
makes into our overrides), with every device tensor on ``meta``, under
:class:`~tests.host_sync_check.HostSyncCheck`; so do the retrieval owner's
re-positioning, the tap's and the plain draft KV copy's records (fake
attention impls) and MRV2's staging and positions. Set-up and the metrics
pull run under the check too, allowed by name."""

import types

import numpy as np
import pytest
import torch

from tests.drafters.fakes import FakeAttention
from tests.host_sync_check import HostSyncCheck
from tests.retrieval.test_host_syncs import ALLOWED
from vllm_specextend.common.engine_setup import SETUP_ATTRIBUTE, EngineSetup
from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.control.goodput import DraftPlan
from vllm_specextend.drafters.v1_overrides import V1Overrides
from vllm_specextend.patches.drafter_instances import hook_attention_impls

META = torch.device("meta")


def meta_layer() -> FakeAttention:
    return FakeAttention(scale=0.25, device=META)


K = 3
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
MAX_REQS = 4
MAX_TOKENS = 512
HIDDEN = 32
TARGET_LAYER = "model.layers.1.self_attn.attn"
DRAFT_LAYER = "draft_model.model.layers.0.self_attn.attn"




class StockProposer:
    """What ``V1Overrides`` needs of vLLM's ``SpecDecodeBaseProposer``: its
    sizes, and the calls its ``propose`` makes into our overrides (metadata
    builds for the first pass and a later draft step, the draft's positions,
    the draft layers' KV writes)."""

    def __init__(self, vllm_config, device, runner=None):
        self.device = device
        self.dtype = torch.float32
        self.max_batch_size = MAX_REQS
        self.max_num_tokens = MAX_TOKENS
        self.max_model_len = MAX_MODEL_LEN
        self.kv_cache_gid = 0
        self.block_size = BLOCK_SIZE
        # vLLM's: a draft model takes its next token in an extra slot, a head does not.
        self.needs_extra_input_slots = getattr(runner, SETUP_ATTRIBUTE).method == "draft_model"
        self.positions = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device)
        self.calls = []

    def propose(self, num_speculative_tokens, **kwargs):
        cad = kwargs["common_attn_metadata"]
        self.calls.append({"draft_steps": num_speculative_tokens,
                           "tokens": cad.num_actual_tokens,
                           "rows": cad.num_reqs})
        self.build_per_group_and_layer_attn_metadata(cad, 0)
        positions = self._get_positions(cad.num_actual_tokens)
        draft_layer = self.retrieval.draft_layers[DRAFT_LAYER]
        key = torch.zeros(cad.num_actual_tokens, 2 * 16, device=self.device)
        draft_layer.impl.do_kv_cache_update(draft_layer, key, key, None, cad.slot_mapping)
        later_step = cad.replace(seq_lens=cad.seq_lens + 1, num_actual_tokens=cad.num_reqs)
        self.build_per_group_and_layer_attn_metadata(later_step, 1)
        self._get_positions(cad.num_reqs)
        assert positions.device == self.device
        return torch.zeros(cad.num_reqs, num_speculative_tokens, dtype=torch.int64,
                           device=self.device)

    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, draft_index=0):
        return [], {}

    def _get_positions(self, num_tokens):
        return self.positions[:num_tokens]


class Proposer(V1Overrides, StockProposer):
    pass


# Steps of goodput control (drafts planned for every request), rows by
# request: a decode step, two paused steps (no draft forward), a step that
# catches up the paused tokens beside a new prompt chunk, a decode step.
PROMPTS = {"a": 1500, "b": 1500, "c": 1500, "d": 64}
STEPS = [
    (K, {"a": (1, 2000), "b": (1, 2500), "c": (1, 1800)}),
    (0, {"a": (K + 1, 2001), "b": (K + 1, 2501), "c": (K + 1, 1801)}),
    (0, {"a": (1, 2003), "b": (1, 2503), "c": (1, 1803)}),
    (K, {"a": (1, 2004), "b": (1, 2504), "c": (1, 1804), "d": (64, 0)}),
    (K, {"a": (K + 1, 2005), "b": (K + 1, 2505), "c": (K + 1, 1805), "d": (K + 1, 64)}),
]


def step_inputs(rows: dict[str, tuple[int, int]]) -> dict:
    """A step's propose() arguments (device tensors on meta, one padding row)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens = np.array([q for q, _ in rows.values()])
    context_lens = np.array([c for _, c in rows.values()])
    num_reqs, num_tokens = len(rows), int(query_lens.sum())
    query_start = np.concatenate([[0], np.cumsum(query_lens), [num_tokens]]).astype(np.int32)
    seq_lens = np.append(context_lens + query_lens, 0).astype(np.int32)
    cad = CommonAttentionMetadata(
        query_start_loc=torch.empty(num_reqs + 2, dtype=torch.int32, device=META),
        query_start_loc_cpu=torch.from_numpy(query_start),
        seq_lens=torch.empty(num_reqs + 1, dtype=torch.int32, device=META),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.empty(num_reqs + 1, MAX_BLOCKS, dtype=torch.int32,
                                       device=META),
        slot_mapping=torch.empty(num_tokens, dtype=torch.int64, device=META),
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens),
    )
    return dict(
        target_token_ids=torch.empty(num_tokens, dtype=torch.int32, device=META),
        target_positions=torch.empty(num_tokens, dtype=torch.int64, device=META),
        target_hidden_states=torch.empty(num_tokens, HIDDEN, device=META),
        next_token_ids=torch.empty(num_reqs, dtype=torch.int32, device=META),
        token_indices_to_sample=torch.empty(num_reqs, dtype=torch.int32, device=META),
        common_attn_metadata=cad,
        sampling_metadata=None,
    )


def runner_for(setup: EngineSetup):
    """The V1 runner's host state that the proposer reads."""
    block_table = np.arange(MAX_REQS * MAX_BLOCKS, dtype=np.int32).reshape(MAX_REQS, -1)
    input_batch = types.SimpleNamespace(
        req_ids=[], num_computed_tokens_cpu=np.zeros(MAX_REQS, dtype=np.int64),
        num_prompt_tokens=np.zeros(MAX_REQS, dtype=np.int64),
        token_ids_cpu=np.arange(MAX_REQS * MAX_MODEL_LEN, dtype=np.int32).reshape(MAX_REQS, -1),
        block_table=[types.SimpleNamespace(get_numpy_array=lambda: block_table)],
    )
    # requests: each request's CachedRequestState (none here: no max_tokens).
    return types.SimpleNamespace(input_batch=input_batch, requests={},
                                 **{SETUP_ATTRIBUTE: setup})


def set_up(method: str, draft_window: int) -> Proposer:
    """The proposer, attached and bound to a KV cache as the runner does."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    config = SpecExtendConfig(mode="cmr", min_context_tokens=1024, sink_tokens=16,
                              recent_tokens=64, chunk_size=32, top_k_chunks=2,
                              retrieval_interval=2, speculation_control="goodput")
    compact = draft_window < MAX_MODEL_LEN
    setup = EngineSetup(config=config, method=method, draft_window=draft_window,
                           num_speculative_tokens=K, compact_positions=compact,
                           steps_in_flight=2)
    proposer = Proposer(None, META, runner_for(setup))
    retrieval = proposer.retrieval
    retrieval.attach({TARGET_LAYER: meta_layer(), DRAFT_LAYER: meta_layer()},
                     {DRAFT_LAYER})
    if method != "draft_model":
        proposer.control.allocate_paused_hidden_states(HIDDEN, torch.float32)
    with set_current_vllm_config(VllmConfig()):
        draft = torch.nn.ModuleDict({"rotary": get_rope(FakeAttention.head_size, MAX_MODEL_LEN)})
    kv_cache_config = types.SimpleNamespace(
        num_blocks=MAX_REQS * MAX_BLOCKS,
        kv_cache_groups=[types.SimpleNamespace(layer_names=[TARGET_LAYER, DRAFT_LAYER])])
    retrieval.bind_kv_cache(kv_cache_config, BLOCK_SIZE, draft)
    hook_attention_impls(retrieval)  # as the runner's KV cache set-up
    return proposer


def script_plans(proposer: Proposer) -> list[int]:
    """Each plan drafts the next step's K for every request (the
    controller's own bookkeeping still runs)."""
    controller = proposer.control.controller
    stock_choose = controller.choose
    plans = [k for k, _ in STEPS]

    def scripted(req_ids, *args, **kwargs):
        stock_choose(req_ids, *args, **kwargs)
        k = plans.pop(0)
        return DraftPlan(np.full(len(req_ids), k), k, 0.0)

    controller.choose = scripted
    return plans


def target_forward(proposer: Proposer, num_tokens: int) -> None:
    """The target's last attention layer over this step: the tap records."""
    layer = proposer.retrieval.target_layer
    query = torch.empty(num_tokens, 4 * 16, device=META)
    key = torch.empty(num_tokens, 2 * 16, device=META)
    layer.impl.forward(layer, query, key, key, None, attn_metadata=object())
    layer.impl.do_kv_cache_update(layer, key, key, None,
                                  torch.empty(num_tokens, dtype=torch.int64, device=META))


def run_steps(proposer: Proposer, steps: list[dict], inputs: list[dict]) -> None:
    """The runner's steps: its host state, the target's forward, propose."""
    input_batch = proposer.runner.input_batch
    for rows, kwargs in zip(steps, inputs):
        input_batch.req_ids = list(rows)
        input_batch.num_computed_tokens_cpu[:len(rows)] = [c for _, c in rows.values()]
        input_batch.num_prompt_tokens[:len(rows)] = [PROMPTS[r] for r in rows]
        target_forward(proposer, kwargs["common_attn_metadata"].num_actual_tokens)
        proposer.propose(K, **kwargs)


@pytest.mark.parametrize("method, draft_window", [
    ("draft_model", MAX_MODEL_LEN),
    ("draft_model", 1024),  # compact positions: re-positioning, shifted positions
    ("eagle3", MAX_MODEL_LEN),  # a head: its kept hidden states
])
def test_v1_proposals_with_pauses_and_catch_up_never_wait_for_the_device(method, draft_window):
    steps = [rows for _, rows in STEPS]
    inputs = [step_inputs(rows) for rows in steps]
    with HostSyncCheck(ALLOWED) as check:
        proposer = set_up(method, draft_window)
        script_plans(proposer)
        run_steps(proposer, steps, inputs)
        proposer.metrics_snapshot()
    check.assert_none()
    # The paused steps skipped the draft's forward; the step after caught up
    # the tokens verified meanwhile, before its rows' queries.
    calls = proposer.calls
    assert [c["rows"] for c in calls] == [3, 4, 4]
    assert calls[1]["tokens"] > sum(q for q, _ in STEPS[3][1].values())
    control = proposer.control
    assert control.controller.stats.catch_up_tokens > 0
    assert control.controller.stats.skipped_draft_forwards == 2
    assert proposer.retrieval.planner.stats.retrievals > 0
    assert (proposer.retrieval.kv_copy is not None) == (draft_window < MAX_MODEL_LEN)
    # Set-up and the metrics pull read the device, as allowed.
    expected = ALLOWED if draft_window < MAX_MODEL_LEN else ALLOWED - {
        "vllm_specextend.retrieval.draft_kv_copy:DraftKVCopy.__init__"}
    assert set(check.allowed) == expected
    assert (proposer.control.paused_hidden is not None) == (method != "draft_model")


def test_both_features_keep_requests_by_one_set_of_slots():
    """The adapter's request slots are the planner's and goodput control's:
    a request that leaves in a step nobody drafts in (no planning then)
    leaves both features at once, and its slot goes to the next request.
    Mutation: the planner keeping slots of its own fails it (it still
    tracks "c" after the paused step)."""
    proposer = set_up("draft_model", MAX_MODEL_LEN)
    plans = script_plans(proposer)
    plans[:] = [K, 0, K]
    planner = proposer.retrieval.planner
    controller = proposer.control.controller
    assert planner.requests is controller.requests is proposer.requests
    steps = [{"a": (1, 2000), "b": (1, 2500), "c": (1, 1800)},
             {"a": (K + 1, 2001), "b": (K + 1, 2501)},  # "c" left; nobody drafts
             {"a": (K + 1, 2005), "b": (K + 1, 2505), "d": (64, 0)}]
    run_steps(proposer, steps[:2], [step_inputs(rows) for rows in steps[:2]])
    assert [c["rows"] for c in proposer.calls] == [3]
    assert sorted(planner.tracked_requests()) == ["a", "b"]
    assert planner.stats.finished_requests == 1
    assert "c" not in proposer.requests
    slot_of_c = 2
    run_steps(proposer, steps[2:], [step_inputs(steps[2])])
    assert dict(proposer.requests.items()) == {"a": 0, "b": 1, "d": slot_of_c}


def test_mrv2_proposals_never_wait_for_the_device(target_model, draft_model, monkeypatch):
    """MRV2's seam as far as it runs without its Triton kernels: planning from
    its ``InputBatch``, staging the view in the persistent buffers, the
    compacted lengths of every metadata build and the compact positions."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.gpu.spec_decode import speculator as speculator_module
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import (
        StandaloneARSpeculator,
    )

    from tests.common.test_engine_setup import capped_draft, engine_config
    from tests.drafters.test_mrv2_draft_model import STREAMING, input_batch
    from vllm_specextend.drafters.mrv2_draft_model import SpecExtendStandaloneARSpeculator

    config = engine_config(target_model, spec_extend=STREAMING, max_num_seqs=4,
                           max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512,
                           speculative_config=capped_draft(1024)(draft_model))
    batches = [input_batch(query_lens=[K + 1, K + 1, K + 1], context_lens=[3000 + i, 2996, 500],
                           prompt_lens=[1000, 3000, 400]) for i in range(3)]
    meta_batches = []
    for batch in batches:
        for name in ("query_start_loc", "seq_lens", "positions"):
            setattr(batch, name, getattr(batch, name).to(META))
        meta_batches.append(batch)
    num_rejected = torch.zeros(3, dtype=torch.int64, device=META)

    def drafting_loop(self, input_batch, *args, **kwargs):
        # The calls MRV2's loop makes into our overrides: a metadata build
        # per step, the draft's forward at its positions, the in-place update.
        num_reqs = input_batch.num_reqs
        self._build_attn_metadata(num_reqs=num_reqs)
        self._run_model(torch.empty(num_reqs, dtype=torch.int64, device=META),
                        self.input_buffers.positions[:num_reqs])
        self._update_draft_decode_metadata({}, num_reqs)
        return torch.zeros(num_reqs, K, dtype=torch.int64, device=META)

    monkeypatch.setattr(StandaloneARSpeculator, "propose", drafting_loop)
    monkeypatch.setattr(StandaloneARSpeculator, "_run_model", lambda self, *args: None)
    monkeypatch.setattr(StandaloneARSpeculator, "_build_attn_metadata",
                        lambda self, **kwargs: {})
    monkeypatch.setattr(StandaloneARSpeculator, "_update_draft_decode_metadata",
                        lambda self, attn_metadata, num_reqs: None)
    monkeypatch.setattr(speculator_module, "init_attn_backend",
                        lambda *args, **kwargs: ([], {}, None))
    # Set-up: vLLM's speculator makes its constants on the device.
    allowed = ALLOWED | {"vllm_specextend.drafters.mrv2_overrides:MRV2Overrides.__init__"}
    with HostSyncCheck(allowed) as check:
        spec = SpecExtendStandaloneARSpeculator(config, META)
        spec.draft_attn_layer_names = {DRAFT_LAYER}
        spec.retrieval.attach({TARGET_LAYER: meta_layer(), DRAFT_LAYER: meta_layer()},
                              spec.draft_attn_layer_names)
        with set_current_vllm_config(config):
            spec.model = torch.nn.ModuleDict({"rotary": get_rope(FakeAttention.head_size,
                                                                 MAX_MODEL_LEN)})
        block_tables = types.SimpleNamespace(
            num_kv_cache_groups=1, block_sizes=[32],
            input_block_tables=[torch.zeros(4, MAX_MODEL_LEN // 32, dtype=torch.int32,
                                            device=META)])
        kv_cache_config = types.SimpleNamespace(
            num_blocks=512,
            kv_cache_groups=[types.SimpleNamespace(layer_names=[TARGET_LAYER, DRAFT_LAYER])])
        spec.set_attn(None, kv_cache_config, block_tables, None, None)
        hook_attention_impls(spec.retrieval)
        for batch in meta_batches:
            spec.propose(batch, {}, {}, None, None, torch.ones(3, device=META), num_rejected)
        spec.retrieval.metrics_snapshot()
    check.assert_none()
    assert spec.retrieval.compact_positions
    assert spec.retrieval.planner.stats.retrievals > 0
