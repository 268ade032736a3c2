"""Retrieval and goodput control's catch-up agree on each row's query.

When a request resumes drafting after a pause, control puts the tokens
verified meanwhile before its query in the draft's first pass; their draft
KV is written then, and they attend like the query's tokens. Retrieval keeps
a recent window before the query: measured before the target's query alone,
a catch-up longer than the window put its own tokens in dropped blocks, and
the draft read them through a view that no longer held them (outputs stay
the target's; the draft's upper-layer KV at those positions, and with it
acceptance, does not).

The V1 adapter runs here over a stand-in for vLLM's proposer on CPU
(``tests/drafters/test_adapter_host_syncs.py``): every first-pass metadata
build of a step with a view must map each first-pass token, catch-up
included, to the slot the target's block table gives it.
"""

import types

import numpy as np
import torch

from tests.drafters.fakes import FakeAttention
from tests.drafters.test_adapter_host_syncs import (
    BLOCK_SIZE,
    DRAFT_LAYER,
    HIDDEN,
    MAX_BLOCKS,
    MAX_MODEL_LEN,
    MAX_REQS,
    TARGET_LAYER,
    K,
    StockProposer,
    runner_for,
)
from vllm_specextend.common.engine_setup import EngineSetup
from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.control.goodput import DraftPlan
from vllm_specextend.drafters.v1_overrides import V1Overrides
from vllm_specextend.patches.drafter_instances import hook_attention_impls

CPU = torch.device("cpu")
RECENT_TOKENS = 64
PROMPT_LEN = 1500
PAUSED_STEPS = 3 * RECENT_TOKENS  # the catch-up: three recent windows


class RecordingStock(StockProposer):
    """vLLM's proposer as the stand-in makes it, keeping the metadata each
    first pass is built with (what the draft's attention reads)."""

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.first_passes = []

    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, draft_index=0):
        if draft_index == 0:
            self.first_passes.append(common_attn_metadata)
        return [], {}


class Proposer(V1Overrides, RecordingStock):
    pass


def set_up() -> Proposer:
    config = SpecExtendConfig(mode="cmr", min_context_tokens=1024, sink_tokens=16,
                              recent_tokens=RECENT_TOKENS, chunk_size=32, top_k_chunks=2,
                              retrieval_interval=1, speculation_control="goodput")
    setup = EngineSetup(config=config, method="draft_model", draft_window=MAX_MODEL_LEN,
                           num_speculative_tokens=K, compact_positions=False,
                           steps_in_flight=2)
    proposer = Proposer(None, CPU, runner_for(setup))
    proposer.retrieval.attach({TARGET_LAYER: FakeAttention(scale=0.25),
                               DRAFT_LAYER: FakeAttention(scale=0.25)}, {DRAFT_LAYER})
    kv_cache_config = types.SimpleNamespace(
        num_blocks=MAX_REQS * MAX_BLOCKS,
        kv_cache_groups=[types.SimpleNamespace(layer_names=[TARGET_LAYER, DRAFT_LAYER])])
    proposer.retrieval.bind_kv_cache(kv_cache_config, BLOCK_SIZE)
    hook_attention_impls(proposer.retrieval)  # as the runner's KV cache set-up
    return proposer


# Request i owns blocks i * MAX_BLOCKS on (the runner's block table).
TABLE = torch.arange(MAX_REQS * MAX_BLOCKS, dtype=torch.int32).view(MAX_REQS, -1)


def step_inputs(query_lens, context_lens) -> dict:
    """A step's propose() arguments on CPU, rows in request order."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens, context_lens = np.array(query_lens), np.array(context_lens)
    num_reqs, num_tokens = len(query_lens), int(query_lens.sum())
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens = (context_lens + query_lens).astype(np.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    rows = torch.repeat_interleave(torch.arange(num_reqs), torch.from_numpy(query_lens))
    slot_mapping = (TABLE[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE
                    + positions % BLOCK_SIZE)
    cad = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(query_start.copy()),
        query_start_loc_cpu=torch.from_numpy(query_start),
        seq_lens=torch.from_numpy(seq_lens),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=TABLE[:num_reqs].clone(),
        slot_mapping=slot_mapping,
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens.copy()),
    )
    return dict(
        target_token_ids=torch.zeros(num_tokens, dtype=torch.int32),
        target_positions=positions,
        target_hidden_states=torch.zeros(num_tokens, HIDDEN),
        next_token_ids=torch.zeros(num_reqs, dtype=torch.int32),
        token_indices_to_sample=torch.from_numpy(query_start[1:] - 1),
        common_attn_metadata=cad,
        sampling_metadata=None,
    )


def run(proposer: Proposer, plans: list[int], steps: list[tuple[list[int], list[int]]]):
    """The runner's steps (the target's last layer recorded, then propose),
    each drafting the planned K for every request."""
    controller = proposer.control.controller
    stock_choose = controller.choose

    def scripted(req_ids, *args, **kwargs):
        stock_choose(req_ids, *args, **kwargs)
        k = plans.pop(0)
        return DraftPlan(np.full(len(req_ids), k), k, 0.0)

    controller.choose = scripted
    generator = torch.Generator().manual_seed(0)
    input_batch = proposer.runner.input_batch
    layer = proposer.retrieval.target_layer
    for query_lens, context_lens in steps:
        kwargs = step_inputs(query_lens, context_lens)
        num_reqs = len(query_lens)
        input_batch.req_ids = [f"req-{i}" for i in range(num_reqs)]
        input_batch.num_computed_tokens_cpu[:num_reqs] = context_lens
        input_batch.num_prompt_tokens[:num_reqs] = PROMPT_LEN
        cad = kwargs["common_attn_metadata"]
        num_tokens = cad.num_actual_tokens
        query = torch.randn(num_tokens, 4 * 16, generator=generator)
        key = torch.randn(num_tokens, 2 * 16, generator=generator)
        layer.impl.forward(layer, query, key, key, None, attn_metadata=object())
        layer.impl.do_kv_cache_update(layer, key, key, None, cad.slot_mapping)
        proposer.propose(K, **kwargs)


def test_the_draft_reads_every_caught_up_token_through_its_view():
    proposer = set_up()
    contexts = np.array([2000, 2600, 3100])
    # A step that drafts, PAUSED_STEPS in which nobody drafts (no draft
    # forward), then one that drafts again and catches up what was verified.
    steps = [([1] * 3, contexts)]
    steps += [([1] * 3, contexts + 1 + step) for step in range(PAUSED_STEPS)]
    steps += [([K + 1] * 3, contexts + 1 + PAUSED_STEPS)]
    run(proposer, [K] + [0] * PAUSED_STEPS + [K], steps)
    assert len(proposer.first_passes) == 2
    cad = proposer.first_passes[-1]  # the step that caught up
    query_start = cad.query_start_loc_cpu.numpy()
    first_pass_lens = np.diff(query_start)
    seq_lens = contexts + 1 + PAUSED_STEPS + K + 1
    assert (first_pass_lens > 2 * RECENT_TOKENS).all()  # caught up, beyond the window
    removed = seq_lens - cad.seq_lens.numpy()
    assert (removed > 0).all() and (removed % BLOCK_SIZE == 0).all()  # compacted
    for row in range(3):
        positions = np.arange(seq_lens[row] - first_pass_lens[row], seq_lens[row])
        target_blocks = TABLE[row, positions // BLOCK_SIZE]
        draft_blocks = cad.block_table_tensor[row, (positions - removed[row]) // BLOCK_SIZE]
        misread = int((draft_blocks != target_blocks).sum())
        assert misread == 0, f"row {row}: {misread} of {len(positions)} first-pass tokens"
