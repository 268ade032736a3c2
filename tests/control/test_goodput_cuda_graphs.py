"""Goodput control under the target's FULL CUDA graphs (vLLM's V1 runner on a
GPU, ``cudagraph_mode`` FULL_AND_PIECEWISE by default).

vLLM's dispatch decision is plain Python (``v1/cudagraph_dispatcher.py`` and
``GPUModelRunner._is_uniform_decode``), run here as the runner calls it:

- a step in which every request verifies ``1 + K`` tokens (stock drafting,
  or goodput control giving every request K) replays the FULL graph stock
  vLLM replays;
- any other decode step (fewer drafts for some request, every request
  paused, the same ``k < K`` for all) runs PIECEWISE: FULL decode graphs are
  captured for ``1 + K`` only, so a step of paused requests does not reach
  the FULL graph the target alone (``K = 0``) replays for it.

So the controller prices leaving the FULL graphs: a ``piecewise_step``
cost feature it learns, and every request drafting K weighed as one more
plan. Without FULL decode graphs (CPU, eager) nothing changes.

Mutations that fail it: dropping the uniform-K plan from
``choose_draft_lengths`` (``test_a_costly_piecewise_step_makes_every_row_draft_k``
and the engine simulation fail); observing every step as FULL (the engine
simulation never learns the cost: "bad" keeps pausing).
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.control.test_goodput import K, SimulatedEngine
from vllm_specextend.common.options import SpecExtendConfigError
from vllm_specextend.control.goodput import (
    ControlParameters,
    GoodputController,
    StepCostModel,
    choose_draft_lengths,
)

CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]


def dispatcher(num_speculative_tokens, mode_name="FULL_AND_PIECEWISE"):
    """vLLM's V1 dispatcher with its keys as the runner initialises them."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    mode = CUDAGraphMode[mode_name]
    compilation = SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=64,
                                  cudagraph_capture_sizes=CAPTURE_SIZES, mode=None,
                                  splitting_ops=[], compile_sizes=[],
                                  is_attention_compiled_piecewise=lambda: True)
    config = SimpleNamespace(compilation_config=compilation, lora_config=None,
                             num_speculative_tokens=num_speculative_tokens,
                             scheduler_config=SimpleNamespace(max_num_seqs=16))
    graphs = CudagraphDispatcher(config)
    graphs.initialize_cudagraph_keys(mode, 1 + num_speculative_tokens)
    return graphs


def dispatch(graphs, query_lens):
    """The runner's decision for a step of ``query_lens``
    (``_determine_batch_execution_and_padding``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    num_tokens = sum(query_lens)
    uniform = GPUModelRunner._is_uniform_decode(
        max_num_scheduled_tokens=max(query_lens),
        uniform_decode_query_len=graphs.uniform_decode_query_len,
        num_tokens=num_tokens, num_reqs=len(query_lens))
    mode, key = graphs.dispatch(num_tokens, uniform_decode=uniform)
    return mode.name, key


def test_which_goodput_steps_reach_the_graphs_stock_vllm_replays():
    speculating, target_alone = dispatcher(K), dispatcher(0)
    rows = 8
    stock = dispatch(speculating, [1 + K] * rows)
    assert stock[0] == "FULL" and stock[1].uniform and stock[1].num_reqs == rows
    # Every request drafting K: the very graph stock drafting replays.
    assert dispatch(speculating, [1 + K] * rows) == stock
    # The same k < K for every request, or a mix: PIECEWISE.
    assert dispatch(speculating, [K] * rows)[0] == "PIECEWISE"
    assert dispatch(speculating, [1 + K] * 4 + [1] * 4)[0] == "PIECEWISE"
    # Every request paused: PIECEWISE, where the target alone replays FULL.
    paused = dispatch(speculating, [1] * rows)
    alone = dispatch(target_alone, [1] * rows)
    assert paused[0] == "PIECEWISE" and alone[0] == "FULL" and alone[1].uniform
    # FULL_DECODE_ONLY has no graph but the 1 + K one: a paused step runs
    # eagerly (goodput control refuses the mode).
    decode_only = dispatcher(K, "FULL_DECODE_ONLY")
    assert dispatch(decode_only, [1 + K] * rows)[0] == "FULL"
    assert dispatch(decode_only, [1] * rows)[0] == "NONE"
    assert dispatch(dispatcher(0, "FULL_DECODE_ONLY"), [1] * rows)[0] == "FULL"
    # With cudagraph_mode FULL (one routine) every captured size is FULL.
    full_only = dispatcher(K, "FULL")
    assert {dispatch(full_only, q)[0] for q in ([1 + K] * rows, [1] * rows, [2, 4, 1])} == {"FULL"}


@pytest.mark.parametrize("mode_name, expected", [
    ("FULL_AND_PIECEWISE", 1 + K), ("FULL_DECODE_ONLY", 1 + K), ("FULL", None),
    ("PIECEWISE", None), ("NONE", None)])
def test_the_engine_says_which_steps_are_full_graphs(mode_name, expected):
    from vllm.config import CUDAGraphMode

    from vllm_specextend.common.engine_setup import full_decode_graph_query_len

    config = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode_name]),
        speculative_config=SimpleNamespace(num_speculative_tokens=K))
    assert full_decode_graph_query_len(config) == expected


def graph_costs(piecewise: float) -> StepCostModel:
    """50 ms a step, 10 ms a verified token, 1 ms a draft step, ``piecewise``
    for a step outside the FULL graphs."""
    model = StepCostModel(K, piecewise_step=True)
    model.weights = np.array([0.05, 0.01, 0.0] + [0.001 * d for d in range(1, K + 1)]
                             + [piecewise])
    model.observations = 100
    return model


SURVIVAL = np.cumprod(np.array([[0.95, 0.9, 0.9], [0.0, 0.0, 0.0], [0.9, 0.5, 0.1]]), axis=1)


def test_a_costly_piecewise_step_makes_every_row_draft_k():
    drafting = np.ones(3, bool)
    # Free to leave the graphs: as without them (tests/control/test_goodput.py).
    free = choose_draft_lengths(SURVIVAL, drafting, graph_costs(0.0), 3, uniform_draft_length=K)
    assert free.draft_lengths.tolist() == [3, 0, 1]
    # Leaving them costs more than the extra drafts' verification: all K.
    costly = choose_draft_lengths(SURVIVAL, drafting, graph_costs(0.1), 3,
                                  uniform_draft_length=K)
    assert costly.draft_lengths.tolist() == [K] * 3 and costly.draft_steps == K
    # A prompt chunk in the step: it is PIECEWISE anyway, no reason to pad.
    chunk = choose_draft_lengths(SURVIVAL, drafting, graph_costs(0.1), 4, other_tokens=100,
                                 uniform_draft_length=K)
    assert chunk.draft_lengths.tolist() == choose_draft_lengths(
        SURVIVAL, drafting, graph_costs(0.1), 4, other_tokens=100).draft_lengths.tolist()
    assert chunk.draft_lengths.tolist() != [K] * 3
    # No FULL graphs: the feature is not used.
    assert choose_draft_lengths(SURVIVAL, drafting, graph_costs(0.1), 3).draft_lengths.tolist() \
        == [3, 0, 1]


class GraphEngine(SimulatedEngine):
    """A simulated engine whose decode steps outside the FULL graphs (not
    every request verifying 1 + K tokens) cost ``piecewise`` seconds more."""

    def __init__(self, controller, acceptance, piecewise):
        super().__init__(controller, acceptance)
        self.piecewise = piecewise

    def step(self):
        query = np.array([self.query[r] for r in self.acceptance])
        if not (query == 1 + K).all():
            self.now += self.piecewise
        return super().step()


@pytest.mark.parametrize("piecewise, bad_drafts", [(0.0, 0), (0.08, K)])
def test_the_controller_learns_what_leaving_the_graphs_costs(piecewise, bad_drafts):
    controller = GoodputController(max_num_reqs=4, num_speculative_tokens=K, free_pause=True,
                                   parameters=ControlParameters(probe_interval=8),
                                   full_graph_query_len=1 + K)
    engine = GraphEngine(controller, {"good": 1.0, "bad": 0.0}, piecewise)
    for _ in range(200):
        engine.step()
    steady = engine.history[-60:]
    # "good" drafts K; "bad" (never accepted) pauses, unless pausing it costs
    # the whole batch its FULL graph: then it drafts K too.
    assert sum(h["good"] == K for h in steady) >= len(steady) - 3
    assert sum(h["bad"] == bad_drafts for h in steady) >= len(steady) - 5
    assert controller.cost.piecewise_cost == pytest.approx(piecewise, abs=0.02)


@pytest.mark.parametrize("built_with, backend_support, settled, query_len", [
    # FULL for mixed batches needs ALWAYS: vLLM falls back to FULL decode
    # graphs only, where a paused step has none: refused once settled.
    ("FULL", "UNIFORM_BATCH", "FULL_DECODE_ONLY", "refused"),
    # A backend without FULL graphs for spec-decode batches: none at all.
    ("FULL_AND_PIECEWISE", "UNIFORM_SINGLE_TOKEN_DECODE", "NONE", None),
    ("FULL_AND_PIECEWISE", "UNIFORM_BATCH", "FULL_AND_PIECEWISE", 1 + K),
])
def test_the_controller_reads_the_graph_mode_vllm_settled_on(
        target_model, draft_model, built_with, backend_support, settled, query_len):
    """vLLM settles ``cudagraph_mode`` once the runner knows its attention
    backends (``GPUModelRunner.initialize_attn_backend``, after the drafter is
    built): the controller must price the graphs the target then replays, not
    those the engine's config asked for. Mutation: the mode read when the
    drafter is built (as until this test) fails both cases."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    from tests.common.test_engine_setup import engine_config
    from tests.drafters.test_adapter_host_syncs import StockProposer, runner_for
    from vllm_specextend.common.engine_setup import resolve_setup
    from vllm_specextend.drafters.v1_overrides import V1Overrides

    class Stock(StockProposer):
        def __init__(self, vllm_config, device, runner=None):
            super().__init__(vllm_config, device, runner)
            self.vllm_config = vllm_config

        def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None):
            pass

    class Proposer(V1Overrides, Stock):
        pass

    config = engine_config(target_model, draft_model,
                           spec_extend={"mode": "off", "speculation_control": "goodput"},
                           speculative_config={"method": "draft_model",
                                               "model": str(draft_model),
                                               "num_speculative_tokens": K})
    compilation = config.compilation_config
    compilation.cudagraph_mode = CUDAGraphMode[built_with]  # as on a GPU
    proposer = Proposer(config, torch.device("cpu"), runner_for(resolve_setup(config)))
    # The runner's initialize_attn_backend, then initialize_metadata_builders.
    compilation.resolve_cudagraph_mode_and_sizes(
        AttentionCGSupport[backend_support], "BACKEND", uniform_decode_query_len=1 + K)
    assert compilation.cudagraph_mode == CUDAGraphMode[settled]
    if query_len == "refused":
        with pytest.raises(SpecExtendConfigError, match="cannot run with cudagraph_mode="
                                                        "FULL_DECODE_ONLY"):
            proposer.initialize_attn_backend(kv_cache_config=None, kernel_block_sizes=[16])
        return
    proposer.initialize_attn_backend(kv_cache_config=None, kernel_block_sizes=[16])
    controller = proposer.control.controller
    assert controller.full_graph_query_len == query_len
    assert controller.cost.piecewise_step == (query_len is not None)
