"""Compact positions in vLLM's V1 runner, exact at every draft step: vLLM's
own ``SpecDecodeBaseProposer.propose`` (its CPU kernels included) runs our
V1 drafters (``drafters/v1_overrides.py``) on CPU for a draft model and an
EAGLE-3 head whose window (1024) is shorter than the contexts, with the
draft's forward replaced by a recorder of the positions it is given. Every
token of every forward (the first pass, then each later draft step) must run
at the position vLLM gives it minus its row's removed tokens; rows the view
leaves whole at vLLM's. The MRV2 counterpart is
``test_mrv2_draft_model.py::test_compact_positions_shift_each_token_by_its_row``.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from tests.common.test_engine_setup import engine_config
from tests.drafters.fakes import FakeAttention
from tests.tiny_models import TARGET_LLAMA
from vllm_specextend.patches.drafter_instances import hook_attention_impls

K = 3
BLOCK_SIZE = 32
WINDOW = 1024
MAX_MODEL_LEN = 4096
TARGET_LAYER = "model.layers.3.self_attn.attn"
DRAFT_LAYER = "draft_model.model.layers.0.self_attn.attn"
STREAMING = {"mode": "streaming", "min_context_tokens": 1024, "sink_tokens": 32,
             "recent_tokens": 64, "chunk_size": 64, "top_k_chunks": 2}
# Rows: a long decode row with one draft rejected, one with none, a short one
# (drafted whole, at vLLM's positions).
CONTEXTS = [3000, 2500, 500]
REJECTED = [1, 0, 0]


class RecordingDraft(torch.nn.Module):
    """The draft's forward: records its positions; its logits make every
    draft token 7. Holds the rotary embedding the KV copy reads."""

    def __init__(self, hidden_size: int, vocab_size: int, proposer):
        torch.nn.Module.__init__(self)
        from vllm.model_executor.layers.rotary_embedding import get_rope

        self.rotary = get_rope(FakeAttention.head_size, MAX_MODEL_LEN)
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.proposer = proposer
        self.forwards: list[dict] = []

    def forward(self, input_ids=None, positions=None, inputs_embeds=None, hidden_states=None):
        # vLLM's own buffer holds the positions it gives each token.
        self.forwards.append({"positions": positions.clone(),
                              "vllm": self.proposer.positions[:positions.shape[0]].clone()})
        hidden = torch.zeros(positions.shape[0], self.hidden_size)
        return hidden if hidden_states is None else (hidden, hidden)

    def compute_logits(self, hidden_states):
        logits = torch.zeros(hidden_states.shape[0], self.vocab_size)
        logits[:, 7] = 1.0
        return logits

    def combine_hidden_states(self, hidden_states):
        return hidden_states[:, :self.hidden_size]


def recording_eagle3_head(hidden_size, vocab_size, proposer):
    """vLLM's propose asserts an EAGLE-3 head is its class."""
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    class Head(RecordingDraft, Eagle3LlamaForCausalLM):
        pass

    return Head(hidden_size, vocab_size, proposer)


class DraftGroup:
    """An attention group of the draft's layer: records what each metadata
    build gets (the view's table and lengths; not what this test checks)."""

    layer_names = [DRAFT_LAYER]

    def __init__(self):
        self.builds = []

    def build_metadata_for_drafting(self, common_attn_metadata, draft_index):
        self.builds.append(draft_index)
        return object()


def proposer_for(method: str, target_model):
    """Our V1 drafter for ``method`` on CPU, set up as vLLM's load_model and
    initialize_attn_backend leave it (with stand-ins for the layers)."""
    from vllm.config import set_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    from tests.eagle_heads import build_eagle_head
    from vllm_specextend.common.engine_setup import SETUP_ATTRIBUTE, kept_setup

    draft = target_model if method == "draft_model" else build_eagle_head(TARGET_LLAMA, method)
    config = engine_config(
        target_model, spec_extend=STREAMING, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=512,
        speculative_config={"method": method, "model": str(draft),
                            "num_speculative_tokens": K, "max_model_len": WINDOW})
    input_batch = types.SimpleNamespace(
        req_ids=[f"req-{i}" for i in range(len(CONTEXTS))],
        num_computed_tokens_cpu=np.array(CONTEXTS + [0], dtype=np.int64),
        num_prompt_tokens=np.array([400] * 4, dtype=np.int64))
    runner = types.SimpleNamespace(input_batch=input_batch,
                                   **{SETUP_ATTRIBUTE: kept_setup(config)})
    # vLLM's CPU versions of its drafting kernels, as its CPU worker registers them.
    current_platform.register_triton_kernel_overrides()
    with set_current_vllm_config(config):
        if method == "draft_model":
            from vllm_specextend.drafters.v1_draft_model import SpecExtendDraftModelProposer

            proposer = SpecExtendDraftModelProposer(config, torch.device("cpu"), runner)
            model = RecordingDraft(proposer.hidden_size, 1024, proposer)
        else:
            from vllm_specextend.drafters.v1_eagle import SpecExtendEagleProposer

            proposer = SpecExtendEagleProposer(config, torch.device("cpu"), runner)
            model = recording_eagle3_head(proposer.hidden_size, 1024, proposer)
        proposer.initialize_cudagraph_keys(CUDAGraphMode.NONE)
    assert proposer.retrieval.compact_positions
    proposer.model = model
    proposer._draft_attn_layer_names = {DRAFT_LAYER}
    proposer.draft_attn_groups = [DraftGroup()]
    proposer.kv_cache_gid, proposer.block_size = 0, BLOCK_SIZE
    proposer.retrieval.attach({TARGET_LAYER: FakeAttention(), DRAFT_LAYER: FakeAttention()},
                              {DRAFT_LAYER})
    kv_cache_config = types.SimpleNamespace(
        num_blocks=4 * MAX_MODEL_LEN // BLOCK_SIZE,
        kv_cache_groups=[types.SimpleNamespace(layer_names=[TARGET_LAYER, DRAFT_LAYER])])
    proposer.retrieval.bind_kv_cache(kv_cache_config, BLOCK_SIZE, model)
    hook_attention_impls(proposer.retrieval)  # as the runner's KV cache set-up
    return proposer


def verification_step(proposer):
    """``propose``'s arguments for a step verifying K drafts in every row,
    as the V1 runner passes them with its padded drafter batch."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    num_reqs, query_len = len(CONTEXTS), K + 1
    contexts = torch.tensor(CONTEXTS)
    query_start = torch.arange(num_reqs + 1, dtype=torch.int32) * query_len
    seq_lens = (contexts + query_len).to(torch.int32)
    positions = torch.cat([torch.arange(c, c + query_len) for c in CONTEXTS])
    max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    block_table = torch.arange(num_reqs * max_blocks, dtype=torch.int32).view(num_reqs, -1)
    rows = torch.arange(num_reqs).repeat_interleave(query_len)
    slot_mapping = (block_table[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE
                    + positions % BLOCK_SIZE)
    rejected = torch.tensor(REJECTED, dtype=torch.int32)
    cad = CommonAttentionMetadata(
        query_start_loc=query_start, query_start_loc_cpu=query_start.clone(),
        seq_lens=seq_lens, num_reqs=num_reqs, num_actual_tokens=num_reqs * query_len,
        max_query_len=query_len, max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table, slot_mapping=slot_mapping,
        seq_lens_cpu_upper_bound=seq_lens.clone())
    num_tokens = num_reqs * query_len
    hidden = proposer.model.hidden_size * (3 if proposer.method == "eagle3" else 1)
    return dict(
        target_token_ids=torch.zeros(num_tokens, dtype=torch.int32),
        target_positions=positions,
        target_hidden_states=torch.zeros(num_tokens, hidden),
        next_token_ids=torch.full((num_reqs,), 5, dtype=torch.int32),
        token_indices_to_sample=query_start[1:] - 1 - rejected,
        common_attn_metadata=cad,
        sampling_metadata=types.SimpleNamespace(all_greedy=True),
        num_rejected_tokens_gpu=rejected)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_every_draft_step_runs_at_original_minus_removed_positions(method, target_model):
    """Mutations that fail it: compacted rows one position off in
    ``_get_positions``; later draft steps left at their first pass's
    per-token shifts, or unshifted."""
    proposer = proposer_for(method, target_model)
    views = []
    plan = proposer.retrieval.plan
    proposer.retrieval.plan = lambda batch: views.append(plan(batch)) or views[-1]
    drafts = proposer.propose(K, **verification_step(proposer))
    assert drafts.tolist() == [[7] * K] * len(CONTEXTS)
    removed = views[0].removed_tokens[:len(CONTEXTS)].long()
    assert (removed[:2] > 0).all() and removed[2] == 0
    forwards = proposer.model.forwards
    assert len(forwards) == K  # the first pass, then K - 1 draft steps
    # The first pass: each row's query (a draft model adds a slot for the
    # next token), rows in order.
    per_row = K + 1 + (method == "draft_model")
    first = forwards[0]
    assert first["vllm"].view(len(CONTEXTS), per_row)[:, 0].tolist() == CONTEXTS
    rows = torch.arange(len(CONTEXTS)).repeat_interleave(per_row)
    want = first["vllm"] - removed[rows]
    # A draft model's rejected slots are at vLLM's position 0 (no token, no
    # KV write): clamped into the window like padding.
    rejected = first["vllm"] == 0
    assert int(rejected.sum()) == sum(REJECTED) * (method == "draft_model")
    assert torch.equal(first["positions"][~rejected], want[~rejected])
    assert (first["positions"][rejected] == 0).all()
    # Each later step: one token per row, one position further.
    for step, forward in enumerate(forwards[1:], start=1):
        sampled = torch.tensor(CONTEXTS) + K - torch.tensor(REJECTED) + step
        sampled += method == "draft_model"  # its first pass ran the next token too
        assert forward["vllm"].tolist() == sampled.tolist(), step
        assert torch.equal(forward["positions"], forward["vllm"] - removed), step
    assert all(int(forward["positions"].max()) < WINDOW for forward in forwards)
