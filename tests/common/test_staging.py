"""Index staging: a step's staged indices survive as many later steps as the
engine keeps in flight (vLLM's ``UvaBufferPool`` rule), and every list starts
at a 16-byte boundary, where Triton's kernels expect their pointers."""

import numpy as np
import pytest
import torch

from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.common.staging import IndexStager
from vllm_specextend.retrieval.planner import RetrievalPlanner


@pytest.mark.parametrize("depth", [2, 3])
def test_staged_indices_survive_the_steps_in_flight(depth):
    stager = IndexStager(max_len=4, device=torch.device("cpu"), depth=depth)
    staged = [stager.next_step()([step, step + 1]) for step in range(depth + 1)]
    # The last `depth` steps are intact; the step before them was reused.
    for step in range(1, depth + 1):
        assert staged[step].tolist() == [step, step + 1]
    assert staged[0].tolist() == [depth, depth + 1]


def test_a_step_cannot_stage_more_lists_than_allocated():
    stager = IndexStager(max_len=2, device=torch.device("cpu"))
    stager.next_step()
    for _ in range(IndexStager.MAX_INDEX_LISTS_PER_STEP):
        stager([0])
    with pytest.raises(RuntimeError, match="index lists staged in one step"):
        stager([0])


def test_planner_stages_with_the_engines_steps_in_flight():
    def planner(steps_in_flight):
        return RetrievalPlanner(SpecExtendConfig(), max_num_reqs=4, max_model_len=1024,
                                max_num_speculative_tokens=3, draft_window=1024,
                                compact_positions=False, device=torch.device("cpu"),
                                steps_in_flight=steps_in_flight)

    assert planner(1)._index_stager.depth == 2
    assert planner(3)._index_stager.depth == 3


def test_staging_buffers_are_told_from_pageable_memory():
    # Where nothing can be pinned (CPU builds) the host sync check accepts
    # non_blocking copies only from buffers registered as staging memory.
    from vllm_specextend.common.staging import host_staging_buffer, is_staging_memory

    buffer = host_staging_buffer((2, 8), torch.int64)
    assert is_staging_memory(buffer) and is_staging_memory(buffer[1, 2:5])
    assert buffer.is_pinned() == torch.cuda.is_available()
    assert not is_staging_memory(torch.zeros(2, 8, dtype=torch.int64))
    assert is_staging_memory(IndexStager(4, torch.device("meta"))._host)
    address = buffer.untyped_storage().data_ptr()
    del buffer
    from vllm_specextend.common import staging

    assert address not in staging._STAGING_STORAGES


def test_lists_staged_together_keep_their_values_and_count_against_the_step():
    stager = IndexStager(max_len=4, device=torch.device("cpu"), lists_per_step=3)
    first, second, empty = stager.next_step().stage([1, 2], torch.tensor([3]).numpy(), [])
    assert (first.tolist(), second.tolist(), empty.tolist()) == ([1, 2], [3], [])
    with pytest.raises(RuntimeError, match="more than 3 index lists"):
        stager([0])


ALIGNMENT = 16
"""Bytes Triton specialises pointer arguments on (``tt.divisibility``)."""


def test_staged_lists_start_at_16_byte_boundaries_and_keep_their_values():
    # Back to back without padding, every other one lay 8 bytes off a boundary.
    lists = [[1, 2, 3], [4, 5, 6], [7], [8], [9, 10, 11]]
    stager = IndexStager(max_len=3, device=torch.device("cpu"), lists_per_step=7)
    staged = stager.next_step().stage(*lists) + stager.stage([12], [])
    assert [view.tolist() for view in staged] == lists + [[12], []]
    assert [view.data_ptr() % ALIGNMENT for view in staged] == [0] * 7


class KernelLaunches:
    """Stands in for the jitted kernels of ``retrieval/kernels/*_triton.py``: records the
    address of every tensor each launch is handed, runs nothing."""

    def __init__(self) -> None:
        self.addresses: list[tuple[str, int, int]] = []
        """(kernel, argument, address % ALIGNMENT) per tensor argument."""

    def __getattr__(self, kernel: str):
        recorder = self

        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    recorder.addresses += [(kernel, i, arg.data_ptr() % ALIGNMENT)
                                           for i, arg in enumerate(args)
                                           if isinstance(arg, torch.Tensor)]
                return launch

        return Launcher()


@pytest.fixture
def kernel_launches(monkeypatch) -> KernelLaunches:
    from vllm_specextend.retrieval.kernels import scoring_triton, selection_triton

    launches = KernelLaunches()
    for module in (scoring_triton, selection_triton):
        monkeypatch.setattr(module, "_kernels", lambda: launches)
        monkeypatch.setattr(module, "_check_device", lambda tensor: None)
    return launches


def random_steps(seed: int, k: int, steps: int = 12) -> list[tuple]:
    """A server's steps: requests joining and leaving, decode rows verifying
    1..K+1 tokens at long contexts, and prompt chunks beyond the draft's window."""
    rng = np.random.default_rng(seed)
    # Two tracked rows, then a new one beside them: three retrieving rows and
    # one due row staged [3, 3, 1, 1, 3] back to back, at [0, 8, 0, 8, 0] % 16.
    batches = [(["a", "b"], [k + 1] * 2, [2000, 2500], [1000] * 2),
               (["a", "b", "c"], [k + 1] * 3, [2004, 2504, 1800], [1000] * 3)]
    pool = [f"r{i}" for i in range(12)]
    for _ in range(steps):
        ids = list(rng.choice(pool, size=rng.integers(1, 6), replace=False))
        query_lens = rng.integers(1, k + 2, size=len(ids))
        context_lens = rng.integers(1100, 3500, size=len(ids))
        prompt_lens = np.minimum(context_lens, 1000)
        if rng.random() < 0.5:  # a prompt chunk of a long prompt
            ids.append(f"prompt-{rng.integers(1 << 30)}")
            query_lens = np.append(query_lens, rng.integers(8, 64))
            context_lens = np.append(context_lens, rng.integers(1100, 2500))
            prompt_lens = np.append(prompt_lens, 3900)
        batches.append((ids, query_lens.tolist(), context_lens.tolist(), prompt_lens.tolist()))
    return batches


@pytest.mark.parametrize("options", ["cmr", "cmr-accepted-tokens", "streaming", "cmr-compact"])
@pytest.mark.parametrize("seed", range(3))
def test_every_index_list_the_planner_hands_a_kernel_is_16_byte_aligned(
        kernel_launches, options, seed):
    """Triton specialises a pointer argument on 16-byte alignment: the
    selection and scoring kernels, warmed up with aligned tensors, would
    compile a new variant mid-serving at the first step whose staged list
    started 8 bytes in (int64 lists back to back, the ones before it of odd
    total length). Every list is staged at a 16-byte boundary instead."""
    from tests.retrieval.test_planner import K, planning_batch
    from tests.retrieval.test_planner_kernels import OPTIONS, make_planner

    planner = make_planner(OPTIONS[options], torch.device("cpu"), kernels=True)
    kernel_launches.addresses.clear()  # the warm-up's own tensors
    for batch in random_steps(seed, K):
        planner.plan(planning_batch(*batch))
    assert kernel_launches.addresses
    misaligned = sorted({launch for launch in kernel_launches.addresses if launch[2]})
    assert not misaligned, f"(kernel, argument, address % 16): {misaligned}"
