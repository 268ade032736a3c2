"""The Triton selection and rewrite kernels (``retrieval/kernels/selection_triton.py``)
equal the torch functions of ``retrieval/kernels/selection.py`` (the reference) on fresh
random rows: ties (rounded scores), chunks scored -inf, top-k from none to
more than the candidates, sinks, recent windows before, inside and past the
table, chunks of 1-4 blocks, chunks past the table's last block, and rows
long enough that both kernels take several loop steps (more than
``CHUNKS_PER_STEP`` chunks, more than ``BLOCKS_PER_STEP`` blocks).

Without a GPU the kernels run under Triton's interpreter in one worker
process (``python -m tests.retrieval.test_selection_triton``; TRITON_INTERPRET=1
must be set before triton is imported, see test_scoring_triton.py); with
CUDA the same rows run on the device too. The seed is fresh per run and
named in each failure (SPECEXTEND_TEST_SEED=N repeats one).

Mutations that fail these tests (each tried): -inf chunks made candidates;
-0.0 ranked below 0.0 (a sort ties them); one tie too many picked; ties
ranked per loop step instead of per row; the recent window's own chunks
made candidates; removed blocks written before the kept ones; the kept
count not carried across loop steps. (Taking the (k+1)-th key as the
threshold is equivalent, so it passes.)
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from tests.triton_interpreter import DEVICES, interpreted_results
from vllm_specextend.retrieval.kernels.selection import rewrite_block_table, select_blocks

pytestmark = pytest.mark.interpreter  # Triton's interpreter in a worker process

SEED = int(os.environ.get("SPECEXTEND_TEST_SEED", random.randrange(1 << 30)))
NUM_CASES = 40
BLOCK_SIZE = 16


def make_case(index: int) -> dict:
    """Case ``index`` of this run; every fourth is a long row with a top-k of
    hundreds, its next scores ties, the one after has -inf chunks."""
    seed = SEED + index
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    batch = rng.randint(1, 4)
    blocks_per_chunk = rng.choice([1, 2, 4])
    num_blocks = (rng.randint(1100, 2100) if index % 4 == 0
                  else rng.choice([rng.randint(1, 40), rng.randint(100, 400)]))
    num_chunks = -(-num_blocks // blocks_per_chunk) + rng.randint(0, 2)
    score = torch.randn(batch, num_chunks, generator=generator)
    if index % 4 == 1 or rng.random() < 0.3:
        score = score.round()  # many ties
    if index % 4 == 2 or rng.random() < 0.2:
        score[torch.rand(score.shape, generator=generator) < 0.2] = -torch.inf
    top_k = rng.choice([0, 1, rng.randint(2, 300), num_chunks + 5])
    return {
        "score": score,
        "recent": torch.randint(0, num_blocks + 3, (batch,), generator=generator,
                                dtype=torch.int32),
        "top_k": rng.randint(257, 400) if index % 4 == 0 else top_k,
        "sink": rng.randint(0, 4),
        "blocks_per_chunk": blocks_per_chunk,
        "num_blocks": num_blocks,
        "table": torch.randperm(batch * num_blocks, generator=generator).int().view(batch, -1),
    }


def run_case(case: dict, use_kernel: bool, device: torch.device) -> dict:
    keep = select_blocks(case["score"].to(device), case["recent"].to(device), case["top_k"],
                         case["sink"], case["blocks_per_chunk"], case["num_blocks"],
                         use_kernel=use_kernel)
    # The rewrite of the reference's selection, so both kernels are checked alone.
    reference_keep = select_blocks(case["score"], case["recent"], case["top_k"], case["sink"],
                                   case["blocks_per_chunk"], case["num_blocks"],
                                   use_kernel=False).to(device)
    compact, removed = rewrite_block_table(case["table"].to(device), reference_keep, BLOCK_SIZE,
                                           use_kernel=use_kernel)
    return {"keep": keep.cpu(), "compact": compact.cpu(), "removed": removed.cpu()}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> list[dict]:
    return interpreted_results("tests.retrieval.test_selection_triton", tmp_path_factory.mktemp("triton-interpreter")
                               / "selection.pt", SEED)




@pytest.mark.parametrize("device", DEVICES)
def test_kernels_equal_the_torch_reference(device, request):
    if device == "cuda":
        got = [run_case(make_case(i), True, torch.device("cuda"))
               for i in range(NUM_CASES)]
    else:
        got = request.getfixturevalue("interpreted")
    for i, kernel in enumerate(got):
        case = make_case(i)
        want = run_case(case, False, torch.device("cpu"))
        message = (f"case {i}: {case['num_blocks']} blocks, top-k {case['top_k']}, "
                   f"seed {SEED} (SPECEXTEND_TEST_SEED={SEED} repeats it)")
        for name in want:
            assert torch.equal(kernel[name], want[name]), f"{name} differs in {message}"


if __name__ == "__main__":  # the interpreter worker (TRITON_INTERPRET=1)
    torch.save([run_case(make_case(i), True, torch.device("cpu"))
                for i in range(NUM_CASES)], sys.argv[1])
