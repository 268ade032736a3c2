"""The Triton chunk-scoring kernel (``retrieval/kernels/scoring_triton.py``) equals the
dense reference (``tests/dense_reference.py``) on fresh random inputs:
permuted block tables, ragged and very short contexts, padding rows, GQA
1 / 4 / 8, head dims 64 / 128, block sizes 16 / 32, chunks of 16-256 tokens
(powers of two, 48 and 96 tokens, and 256 = two granules), fp32 / fp16 /
bf16, and a batch scored in row groups.

Without a GPU the kernel runs under Triton's interpreter in ONE worker
process (``python -m tests.retrieval.test_scoring_triton``): TRITON_INTERPRET=1
only takes effect when set before triton is first imported, and setting it
in this process would turn every other Triton kernel of the test run
(vLLM's included) into interpreted ones. With CUDA the same cases run here,
on the device. The seed is fresh per run and named in each failure
(SPECEXTEND_TEST_SEED=N repeats one).

Mutations of the kernel that fail these tests (each tried, cases failed):
the softmax scale dropped (all 8); the causal limit ignored (7, all with
more than one query row); padding rows seeing position 0 (7, those with
padding); the GQA head mapping permuted (6, those with GQA > 1); a block
table ignored for a contiguous slot range (all 8); no -inf written past a
row's last visible position (all 8); a long chunk reduced to its first
granule (chunk 256); every row group written to the first rows (the
row-group case). Not observable here: that keys past a row's last visible
position are never loaded (a bandwidth property; the causal mask hides them).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass

import pytest
import torch

from tests.dense_reference import attention_scores, context_keys
from tests.triton_interpreter import DEVICES, interpreted_results
from vllm_specextend.retrieval.kernels.scoring import ScoringWorkspace, chunk_attention_sums

pytestmark = pytest.mark.interpreter  # Triton's interpreter in a worker process

SEED = int(os.environ.get("SPECEXTEND_TEST_SEED", random.randrange(1 << 30)))
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    name: str
    context_lens: tuple[int, ...]
    rows: int  # query rows per request (the last `rows` positions)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    chunk_size: int
    dtype: str
    padding: bool = True  # the first query row of the last request is padding
    row_groups: bool = False  # partials for one row only: one launch per row


CASES = [
    Case("mha-d64-b16-c16-fp32", (150, 37), 3, 2, 2, 64, 16, 16, "fp32"),
    Case("gqa4-d128-b16-c32-bf16", (200, 5, 64), 5, 8, 2, 128, 16, 32, "bf16"),
    Case("gqa8-d64-b32-c64-fp16", (300, 97), 2, 8, 1, 64, 32, 64, "fp16"),
    Case("gqa4-d64-b16-c48-bf16", (260, 1, 49), 4, 4, 1, 64, 16, 48, "bf16"),
    Case("gqa1-d128-b32-c128-fp32", (129, 400), 1, 2, 2, 128, 32, 128, "fp32", padding=False),
    Case("gqa8-d128-b32-c96-fp16", (190, 2), 2, 8, 1, 128, 32, 96, "fp16"),
    Case("gqa4-d64-b16-c256-fp32", (600, 300), 2, 4, 1, 64, 16, 256, "fp32"),
    Case("gqa4-d64-b16-c32-bf16-row-groups", (90, 33, 140), 3, 4, 1, 64, 16, 32, "bf16",
         row_groups=True),
]


def make_inputs(case: Case, seed: int) -> dict:
    """Keys scattered over a buffer through a permuted block table; query
    rows at each request's last positions, some of them padding."""
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    batch = len(case.context_lens)
    max_blocks = -(-max(case.context_lens) // case.block_size)
    spare_blocks = 3  # slots no request owns
    num_slots = (batch * max_blocks + spare_blocks) * case.block_size
    key_buffer = torch.randn(num_slots, case.num_kv_heads, case.head_dim,
                             generator=generator).to(dtype)
    block_table = torch.randperm(batch * max_blocks + spare_blocks,
                                 generator=generator)[: batch * max_blocks]
    queries = torch.randn(batch, case.rows, case.num_heads, case.head_dim,
                          generator=generator).to(dtype)
    context_lens = torch.tensor(case.context_lens)
    positions = context_lens.view(-1, 1) - torch.arange(case.rows, 0, -1).view(1, -1)
    positions = positions.clamp(min=-1)  # a context shorter than the rows: padding
    if case.padding:
        positions[-1, 0] = -1
    return {
        "queries": queries,
        "query_positions": positions,
        "key_buffer": key_buffer,
        "block_table": block_table.view(batch, max_blocks).int(),
        "max_context_len": max(case.context_lens),
        "scale": case.head_dim ** -0.5,
    }


def kernel_sums(case: Case, inputs: dict, device: torch.device) -> torch.Tensor:
    """The planner's call, on a kernel workspace."""
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    batch, rows = inputs["query_positions"].shape
    workspace = ScoringWorkspace.allocate(
        case.num_heads, case.num_kv_heads, case.head_dim, max_num_reqs=batch,
        max_query_rows=rows, dtype=DTYPES[case.dtype], device=device, use_kernel=True,
        max_context_len=inputs["max_context_len"])
    if case.row_groups:
        granules = -(-inputs["max_context_len"] // case.chunk_size)
        workspace.granule_logsumexp = workspace.granule_logsumexp[
            : rows * case.num_heads * granules]
    return chunk_attention_sums(
        on_device["queries"], on_device["query_positions"], on_device["key_buffer"],
        on_device["block_table"], inputs["max_context_len"], inputs["scale"],
        case.block_size, case.chunk_size, workspace).cpu()


def dense_sums(case: Case, inputs: dict) -> torch.Tensor:
    """Float32 softmax over each row's whole gathered context, summed per chunk."""
    max_len = inputs["max_context_len"]
    keys = context_keys(inputs["key_buffer"], inputs["block_table"], max_len, case.block_size)
    token_scores = attention_scores(inputs["queries"], keys, inputs["query_positions"],
                                    inputs["scale"]).sum(dim=1)
    chunks = -(-max_len // case.chunk_size)
    padded = torch.nn.functional.pad(token_scores, (0, chunks * case.chunk_size - max_len))
    return padded.view(len(case.context_lens), chunks, case.chunk_size).sum(dim=-1)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Every case's kernel sums from one interpreter worker process."""
    return interpreted_results("tests.retrieval.test_scoring_triton", tmp_path_factory.mktemp("triton-interpreter")
                               / "sums.pt", SEED)




@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
@pytest.mark.parametrize("device", DEVICES)
def test_kernel_equals_the_dense_reference(case, device, request):
    inputs = make_inputs(case, SEED)
    if device == "cuda":
        got = kernel_sums(case, inputs, torch.device("cuda"))
    else:
        got = request.getfixturevalue("interpreted")[case.name]
    want = dense_sums(case, inputs)
    message = f"seed {SEED} (SPECEXTEND_TEST_SEED={SEED} repeats it)"
    assert got.shape == want.shape, message
    # Float32 products of the same inputs, summed in another order.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5, msg=lambda m: f"{m}\n{message}")
    # Each valid query row spreads probability 1 per head over its context.
    valid_rows = (inputs["query_positions"] >= 0).sum(dim=1).float()
    torch.testing.assert_close(got.sum(dim=1), valid_rows * case.num_heads, rtol=1e-4, atol=1e-4)


AOT_SCRIPT = """
import json, os, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_specextend.retrieval.kernels import _scoring_triton_kernels as source
from vllm_specextend.retrieval.kernels import _selection_triton_kernels as selection
from vllm_specextend.retrieval.kernels.scoring_triton import (
    CHUNKS_BLOCK_C, CHUNKS_BLOCK_RH, MEANS_BLOCK_C, SPLITS_BLOCK)
from vllm_specextend.retrieval.kernels.selection_triton import BLOCKS_PER_STEP, CHUNKS_PER_STEP

def compile(fn, types, constexprs, aligned=()):
    # As the launcher specialises: unit strides become constants, pointers
    # and the key strides are known multiples of 16.
    kernel = triton.jit(fn)
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = [n for n in names if n.endswith("_ptr")] + list(aligned)
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3})
    path = os.path.join(sys.argv[1], fn.__name__ + ".cubin")
    open(path, "wb").write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    ptx = compiled.asm["ptx"]
    return {"mma": "mma.sync" in ptx or "wgmma" in ptx,
            "async_16_byte_loads": ptx.count("cp.async.cg.shared.global"),
            "usage": usage.strip().splitlines()[-1]}

granules_types = {
    "q_ptr": "*bf16", "qpos_ptr": "*i64", "last_ptr": "*i32", "start_ptr": "*i32",
    "rows_ptr": "*i64", "k_ptr": "*bf16", "table_ptr": "*i32", "work_ptr": "*i64",
    "lse_ptr": "*fp32", "split_lse_ptr": "*fp32", "scale_log2": "fp32"}
granules_constants = dict(
    q_stride_d=1, k_stride_d=1, GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=32,
    BLOCK_SIZE=16, GRANULE=32, GRANULE_PAD=32, GRANULES_PER_TILE=2, PRECISION="tf32",
    DOT_IN_FP32=False)
chunks_types = {"lse_ptr": "*fp32", "split_lse_ptr": "*fp32", "work_ptr": "*i64",
                "rows_ptr": "*i64", "seq_lens_ptr": "*i32", "slots_ptr": "*i64",
                "out_ptr": "*fp32"}
chunks_constants = dict(GRANULES_PER_CHUNK=1, BLOCK_RH=CHUNKS_BLOCK_RH, BLOCK_C=CHUNKS_BLOCK_C,
                        BLOCK_S=SPLITS_BLOCK)
found = {
    # The planner's scoring (a work list, queries read by token) and the
    # uniform rows of chunk_attention_sums.
    "granules": compile(source.granule_logsumexp_kernel, granules_types,
                        dict(granules_constants, WORK_LIST=True),
                        aligned=["k_stride_slot", "k_stride_h", "num_heads"]),
    "granules-uniform": compile(source.granule_logsumexp_kernel, granules_types,
                                dict(granules_constants, WORK_LIST=False),
                                aligned=["k_stride_slot", "k_stride_h", "num_heads"]),
    "chunks": compile(source.chunk_scores_kernel, chunks_types,
                      dict(chunks_constants, WORK_LIST=True, OUTPUT=1)),
    "chunks-uniform": compile(source.chunk_scores_kernel, chunks_types,
                              dict(chunks_constants, WORK_LIST=False, OUTPUT=0)),
    # The planner's small launches around scoring (the means of
    # tensor-parallel ranks, the selection with the rewrite and the record,
    # the rewrite alone): the types the planner passes.
    "means": compile(source.chunk_means_kernel,
        {"sums_ptr": "*fp32", "rows_ptr": "*i64", "seq_lens_ptr": "*i32", "slots_ptr": "*i64",
         "out_ptr": "*fp32"}, dict(ACCUMULATE=True, BLOCK_C=MEANS_BLOCK_C)),
    "select": compile(selection.select_blocks_kernel,
        {"score_ptr": "*fp32", "recent_ptr": "*i64", "keep_ptr": "*i8"},
        dict(BY_POSITION=False, BLOCK_C=CHUNKS_PER_STEP, BLOCK_B=BLOCKS_PER_STEP)),
    "select-and-compact": compile(selection.select_and_compact_kernel,
        {"score_ptr": "*fp32", "selected_ptr": "*i8", "table_ptr": "*i32", "out_ptr": "*i32",
         "removed_ptr": "*i32", "slot_of_row_ptr": "*i64", "due_of_row_ptr": "*i64",
         "seq_lens_ptr": "*i32", "start_ptr": "*i32", "window_start_ptr": "*i32",
         "last_ptr": "*i32", "kept_lens_ptr": "*i32", "per_slot_ptr": "*i64",
         "totals_ptr": "*i64"},
        dict(BY_POSITION=False, ZERO_SCORES=True, BLOCK_C=CHUNKS_PER_STEP,
             BLOCK_B=BLOCKS_PER_STEP)),
    "compact": compile(selection.compact_block_table_kernel,
        {"table_ptr": "*i32", "keep_ptr": "*i8", "out_ptr": "*i32", "removed_ptr": "*i32",
         "slot_of_row_ptr": "*i64", "seq_lens_ptr": "*i32", "start_ptr": "*i32",
         "last_ptr": "*i32", "kept_lens_ptr": "*i32", "per_slot_ptr": "*i64",
         "totals_ptr": "*i64"},
        dict(RECORD=True, BLOCK_B=BLOCKS_PER_STEP)),
}
print(json.dumps(found))
"""


def test_kernels_compile_for_an_h100_without_spills(tmp_path):
    """The interpreter checks what the kernels compute, not that they
    compile: compile both scoring kernels (the planner's work-list variant
    and the uniform one) and the planner's small ones for sm_90 (Triton's
    bundled ptxas; no GPU needed), the 8B-class bf16 configuration,
    specialised as the launcher does. The logits are a tensor-core MMA, the
    keys arrive as pipelined 16-byte async copies, and nothing spills (no
    local memory, no stack). Fails on a tile loop left unpipelined
    (``num_stages=1``: no async copies; tried on the work-list kernel), and
    failed on the logits as a broadcast product instead of ``tl.dot`` and on
    the former normaliser launch's 64 x 128 tile (a 640-byte stack)."""
    result = subprocess.run([sys.executable, "-c", AOT_SCRIPT, str(tmp_path)],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TRITON_DEFAULT_FP_FUSION": "1",
                                 "TRITON_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for kernel in ("granules", "granules-uniform"):
        assert found[kernel]["mma"], found
        # The keys: 16-byte copies into shared memory, a tile ahead of the MMA.
        assert found[kernel]["async_16_byte_loads"] > 0, found
    for kernel, info in found.items():
        assert " LOCAL:0 " in info["usage"] and " STACK:0 " in info["usage"], (kernel, info)


def _interpreter_worker(out_path: str) -> None:
    """Runs every case under the interpreter (TRITON_INTERPRET=1 set by the caller)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    # The planner's warm-up call (a compile on CUDA) runs on the same path.
    ScoringWorkspace.allocate(8, 2, 64, 2, 5, torch.bfloat16, torch.device("cpu"),
                              use_kernel=True, max_context_len=64).warm_up(16, 48)
    sums = {case.name: kernel_sums(case, make_inputs(case, SEED), torch.device("cpu"))
            for case in CASES}
    torch.save(sums, out_path)
    print(json.dumps({"cases": [asdict(case)["name"] for case in CASES]}))


if __name__ == "__main__":
    _interpreter_worker(sys.argv[1])
