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
