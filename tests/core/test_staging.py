"""Index staging: a step's staged indices survive as many later steps as the
engine keeps in flight (vLLM's ``UvaBufferPool`` rule)."""

import pytest
import torch

from vllm_specextend.core.options import SpecExtendConfig
from vllm_specextend.core.planner import RetrievalPlanner
from vllm_specextend.core.staging import IndexStager


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
    from vllm_specextend.core.staging import host_staging_buffer, is_staging_memory

    buffer = host_staging_buffer((2, 8), torch.int64)
    assert is_staging_memory(buffer) and is_staging_memory(buffer[1, 2:5])
    assert buffer.is_pinned() == torch.cuda.is_available()
    assert not is_staging_memory(torch.zeros(2, 8, dtype=torch.int64))
    assert is_staging_memory(IndexStager(4, torch.device("meta"))._host)
    address = buffer.untyped_storage().data_ptr()
    del buffer
    from vllm_specextend.core import staging

    assert address not in staging._STAGING_STORAGES


def test_lists_staged_together_keep_their_values_and_count_against_the_step():
    stager = IndexStager(max_len=4, device=torch.device("cpu"), lists_per_step=3)
    first, second, empty = stager.next_step().stage([1, 2], torch.tensor([3]).numpy(), [])
    assert (first.tolist(), second.tolist(), empty.tolist()) == ([1, 2], [3], [])
    with pytest.raises(RuntimeError, match="more than 3 index lists"):
        stager([0])
