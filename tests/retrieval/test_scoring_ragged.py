"""The planner's scoring launches (``scoring_triton.score_rows_triton``: the
scoring kernel over a work list built from each row's length, its query
rows read from the tap by the row's last token, then the chunk-score
launch's means into request slots) equal the float32 dense reference
(``tests/dense_reference.py``) and the torch path (``chunk_attention_sums``
on gathered query rows) on ragged batches: a row of one token, a row at
``max_model_len``, long rows beside short ones, batch rows that are not
scored (prompt chunks, untracked rows: their slots untouched), rejected
drafts (the last token before the query's end), padding query rows, a
chunk of two granules, and a batch scored in row groups.

Without a GPU the kernels run under Triton's interpreter in one worker
process (``python -m tests.retrieval.test_scoring_ragged``; see
test_scoring_triton.py); with CUDA the same cases run on the device too.
Fixed inputs (seed 0), small enough for the interpreter.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.dense_reference import attention_scores, context_keys
from tests.triton_interpreter import DEVICES, interpreted_results
from vllm_specextend.retrieval.kernels.scoring import ScoringWorkspace, chunk_attention_sums
from vllm_specextend.retrieval.kernels.scoring_triton import score_rows_triton, stage_work
from vllm_specextend.retrieval.kernels.scoring_work import WorkLists

pytestmark = pytest.mark.interpreter  # Triton's interpreter in a worker process

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
UNSCORED = 7.0
"""What the slots of rows not scored hold, before and after."""


@dataclass(frozen=True)
class Case:
    name: str
    seq_lens: tuple[int, ...]  # the batch's rows, query included
    query_lens: tuple[int, ...]
    scored: tuple[int, ...]  # batch rows scored, in the order given
    rows: int  # query rows scored per row
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    chunk_size: int
    dtype: str
    max_model_len: int
    output: str  # "means", "add-means" or "sums"
    rejected: int = 0  # drafts rejected in the last scored row
    row_groups: bool = False  # a workspace for one long row: the batch in groups


CASES = [
    Case("one-token-and-max-len-rows", (1, 640, 37, 512, 200), (1, 3, 2, 512, 3), (0, 1, 2, 4),
         3, 8, 2, 64, 16, 32, "fp32", 640, "means", rejected=1),
    Case("chunk-of-two-granules-bf16", (300, 700, 5, 512), (2, 64, 1, 2), (3, 0, 2),
         1, 4, 1, 64, 16, 256, "bf16", 768, "add-means"),
    Case("row-groups-fp16", (640, 33, 600, 1, 129), (3, 3, 1, 1, 3), (4, 0, 1, 2, 3),
         3, 8, 1, 64, 32, 64, "fp16", 640, "sums", row_groups=True),
]


def make_inputs(case: Case) -> dict:
    """A batch as the planner sees it: the tap's queries by token, their
    positions, the batch's query starts, last tokens, lengths and a
    permuted block table; request slots for the scored rows."""
    generator = torch.Generator().manual_seed(0)
    dtype = DTYPES[case.dtype]
    batch = len(case.seq_lens)
    max_blocks = -(-case.max_model_len // case.block_size)
    num_blocks = batch * max_blocks + 3  # and blocks no row owns
    key_buffer = torch.randn(num_blocks * case.block_size, case.num_kv_heads, case.head_dim,
                             generator=generator).to(dtype)
    table = torch.randperm(num_blocks, generator=generator)[: batch * max_blocks]
    query_start = np.concatenate([[0], np.cumsum(case.query_lens)])
    positions = np.concatenate([np.arange(n - q, n) for n, q in zip(case.seq_lens,
                                                                    case.query_lens)])
    last = query_start[1:] - 1
    last[case.scored[-1]] -= case.rejected
    return {
        "queries": torch.randn(int(query_start[-1]), case.num_heads, case.head_dim,
                               generator=generator).to(dtype),
        "positions": torch.from_numpy(positions),
        "query_start_loc": torch.from_numpy(query_start).int(),
        "last_token_indices": torch.from_numpy(last).int(),
        "seq_lens": torch.tensor(case.seq_lens, dtype=torch.int32),
        "block_table": table.view(batch, max_blocks).int(),
        "key_buffer": key_buffer,
        "rows": torch.tensor(case.scored, dtype=torch.int64),
        # Slots in another order than the rows, one spare.
        "slots": torch.tensor(list(range(len(case.scored)))[::-1], dtype=torch.int64) + 1,
        "scale": case.head_dim ** -0.5,
    }


def query_rows(case: Case, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The scored rows' query rows, the last first, and their positions
    (-1: padding before the row's query), as the planner's torch path gathers them."""
    rows = inputs["rows"]
    index = inputs["last_token_indices"][rows].long().view(-1, 1) - torch.arange(case.rows)
    valid = index >= inputs["query_start_loc"][rows].view(-1, 1)
    index = index.clamp(min=0)
    return inputs["queries"][index], torch.where(valid, inputs["positions"][index], -1)


def kernel_scores(case: Case, inputs: dict, device: torch.device) -> torch.Tensor:
    """The planner's scoring call: sums, or the slots' means (all slots)."""
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    scored = len(case.scored)
    workspace = ScoringWorkspace.allocate(
        case.num_heads, case.num_kv_heads, case.head_dim, max_num_reqs=scored,
        max_query_rows=case.rows, dtype=DTYPES[case.dtype], device=device, use_kernel=True,
        max_context_len=case.max_model_len)
    if case.row_groups:  # one row at max_model_len at a time, at least
        granules = -(-case.max_model_len // case.chunk_size)
        workspace.granule_logsumexp = workspace.granule_logsumexp[
            : (granules + 5) * case.rows * case.num_heads]
    lists = WorkLists(len(case.seq_lens), device, depth=2)
    lists.next_step()
    lists.stage(np.array([5, 9]), case.chunk_size, 16, 4, 1, 1 << 20)  # another list first
    seq_lens = np.array(case.seq_lens, dtype=np.int64)[list(case.scored)]
    work = stage_work(lists, seq_lens, case.rows, case.chunk_size, workspace)
    assert case.row_groups == (len(work.groups) > 1)
    out = None
    if case.output != "sums":
        out = torch.full((scored + 2, -(-case.max_model_len // case.chunk_size)), UNSCORED,
                         device=device)
    return score_rows_triton(
        work, on["rows"], on["queries"], on["positions"], on["last_token_indices"],
        on["query_start_loc"], on["seq_lens"], on["block_table"], on["key_buffer"], case.rows,
        on["scale"], case.block_size, case.chunk_size, workspace, out=out, slots=on["slots"],
        accumulate=case.output == "add-means").cpu()


def dense_sums(case: Case, inputs: dict) -> torch.Tensor:
    """Float32 softmax over each scored row's whole context, summed per chunk."""
    queries, positions = query_rows(case, inputs)
    rows = inputs["rows"]
    longest = int(inputs["seq_lens"][rows].max())
    keys = context_keys(inputs["key_buffer"], inputs["block_table"][rows], longest,
                        case.block_size)
    token = attention_scores(queries, keys, positions, inputs["scale"]).sum(dim=1)
    chunks = -(-longest // case.chunk_size)
    token = torch.nn.functional.pad(token, (0, chunks * case.chunk_size - longest))
    return token.view(len(rows), chunks, case.chunk_size).sum(dim=-1)


def torch_path_sums(case: Case, inputs: dict) -> torch.Tensor:
    """``chunk_attention_sums`` on the torch path, on the gathered query rows."""
    queries, positions = query_rows(case, inputs)
    rows = inputs["rows"]
    workspace = ScoringWorkspace.allocate(case.num_heads, case.num_kv_heads, case.head_dim,
                                          len(rows), case.rows, DTYPES[case.dtype],
                                          torch.device("cpu"), use_kernel=False)
    return chunk_attention_sums(queries, positions, inputs["key_buffer"],
                                inputs["block_table"][rows], int(inputs["seq_lens"][rows].max()),
                                inputs["scale"], case.block_size, case.chunk_size, workspace)


def as_output(case: Case, inputs: dict, sums: torch.Tensor) -> torch.Tensor:
    """Sums as the kernel writes them: the slots' means (the rest of the
    slot's row zeroed, or added to what it held), other slots untouched."""
    if case.output == "sums":
        return sums
    rows = inputs["rows"]
    chunk_start = torch.arange(sums.shape[1]) * case.chunk_size
    tokens = (inputs["seq_lens"][rows].view(-1, 1) - chunk_start).clamp(0, case.chunk_size)
    width = -(-case.max_model_len // case.chunk_size)
    out = torch.full((len(rows) + 2, width), UNSCORED)
    means = torch.zeros(len(rows), width)
    means[:, : sums.shape[1]] = sums / tokens.clamp(min=1)
    out[inputs["slots"]] = means + (UNSCORED if case.output == "add-means" else 0.0)
    return out


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, torch.Tensor]:
    return interpreted_results("tests.retrieval.test_scoring_ragged",
                               tmp_path_factory.mktemp("triton-interpreter") / "ragged.pt")


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
@pytest.mark.parametrize("device", DEVICES)
def test_ragged_scores_equal_the_dense_reference_and_the_torch_path(case, device, request):
    inputs = make_inputs(case)
    if device == "cuda":
        got = kernel_scores(case, inputs, torch.device("cuda"))
    else:
        got = request.getfixturevalue("interpreted")[case.name]
    dense = dense_sums(case, inputs)
    want = as_output(case, inputs, dense)
    assert got.shape == want.shape
    # Float32 products of the same inputs, summed in another order.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    # The torch path rounds logits to the model dtype: a looser bound.
    torch.testing.assert_close(got, as_output(case, inputs, torch_path_sums(case, inputs)),
                               rtol=3e-2, atol=1e-5)
    # Each valid query row spreads probability 1 per head over its context.
    valid_rows = (query_rows(case, inputs)[1] >= 0).sum(dim=1).float()
    torch.testing.assert_close(dense.sum(dim=1), valid_rows * case.num_heads)
    assert (valid_rows == case.rows).any()
    assert case.rows == 1 or (valid_rows < case.rows).any()  # some padding


if __name__ == "__main__":  # the interpreter worker (TRITON_INTERPRET=1)
    torch.save({case.name: kernel_scores(case, make_inputs(case), torch.device("cpu"))
                for case in CASES}, sys.argv[1])
