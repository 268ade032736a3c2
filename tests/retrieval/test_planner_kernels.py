"""The planner on its CUDA kernels (``use_kernels``: the scoring launches over
a work list of the rows' lengths, writing the chunk means into the request
slots, and one launch for selection, the table rewrite and the step record)
plans what it plans on torch ops: the same draft views (block
tables, removed tokens, kept context lengths, re-positioned rows), chunk
scores and metrics, step after step, for cmr (scored at the last token and
over the accepted tokens, refreshed by acceptance), streaming and compact
positions with windowed prompt chunks.

Without a GPU the kernel planner runs under Triton's interpreter in one
worker process (see test_scoring_triton.py); with CUDA also on the device.
Fixed inputs (seed 0): scores of the two paths differ in the last float bits,
so selections agree unless two chunks tie to that precision, which these do
not.

Mutations that fail it (each tried): the gathered query rows one token off;
a one-token chunk's mean halved; tokens gained counted without the +1; a
one-token query counted as a verification; the due slots' accepted-token
scores never zeroed by the select-and-rewrite launch. (Selection and the rewrite have
their own, finer test: test_selection_triton.py.)
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.retrieval.test_planner import BLOCK_SIZE, ROWS, K, planning_batch, to_device
from tests.triton_interpreter import DEVICES, interpreted_results
from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.retrieval.kernels.scoring import ScoringWorkspace
from vllm_specextend.retrieval.planner import RetrievalPlanner
from vllm_specextend.retrieval.target_tap import TargetAttentionTap

pytestmark = pytest.mark.interpreter  # Triton's interpreter in a worker process

OPTIONS = {
    "cmr": {"mode": "cmr"},
    "cmr-accepted-tokens": {"mode": "cmr", "score_aggregation": "accepted_tokens"},
    "cmr-acceptance-refresh": {"mode": "cmr", "retrieval_refresh": "acceptance"},
    "streaming": {"mode": "streaming"},
    "cmr-compact": {"mode": "cmr", "draft_window": 1024},
}
NUM_SLOTS = 5 * 256 * BLOCK_SIZE
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def make_planner(options: dict, device: torch.device, kernels: bool) -> RetrievalPlanner:
    options = dict(options)
    draft_window = options.pop("draft_window", 4096)
    # A recent window that ends mid-block; as many request slots as rows.
    config = SpecExtendConfig(min_context_tokens=1024, sink_tokens=16, recent_tokens=60,
                              chunk_size=32, top_k_chunks=4, retrieval_interval=2, **options)
    compact = draft_window < 4096
    planner = RetrievalPlanner(config, max_num_reqs=5, max_model_len=4096,
                               max_num_speculative_tokens=K, draft_window=draft_window,
                               compact_positions=compact, device=device)
    planner.use_kernels = kernels
    planner.scoring_workspace = ScoringWorkspace.allocate(
        HEADS, KV_HEADS, HEAD_DIM, 8, K + 1, torch.float32, device, use_kernel=kernels,
        max_context_len=4096)
    generator = torch.Generator().manual_seed(0)
    tap = TargetAttentionTap(num_slots=NUM_SLOTS, max_num_tokens=1024, num_heads=HEADS,
                             num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=0.25,
                             dtype=torch.float32, device=device)
    tap.keys.copy_(torch.randn(tap.keys.shape, generator=generator))
    tap.queries.copy_(torch.randn(tap.queries.shape, generator=generator))
    planner.bind_kv_cache(tap, BLOCK_SIZE)
    return planner


def steps(device: torch.device) -> list:
    """A step of five other requests; four steps of ``ROWS`` four tokens apart (retrievals due at the first
    and third, the third after a catch-up; some drafts rejected at the second; at the fourth
    ``reduced_k`` drafted nothing and ``full_k``'s last chunk holds one
    token), then one without ``full_k``."""
    # First, five other requests retrieve and leave: every slot then holds a
    # selection that the untracked rows below must not read.
    batches = [planning_batch([f"other-{i}" for i in range(5)], [K + 1] * 5,
                              [2000 + 100 * i for i in range(5)], [1000] * 5)]
    for step in range(4):
        rows = dict(ROWS, context_lens=[c + 4 * step - 8 for c in ROWS["context_lens"]])
        if step == 3:
            rows["query_lens"] = [K + 1, 1] + ROWS["query_lens"][2:]
        batch = planning_batch(**rows)
        if step == 1:
            batch.last_token_indices = batch.last_token_indices - torch.tensor([2, 1, 0, 0, 0])
        if step == 2:
            # Goodput control's catch-up before the first rows' queries: the
            # recent windows start before it (it changes their selections).
            lens = torch.tensor(rows["query_lens"]) + torch.tensor([100, 40, 0, 0, 0])
            batch.draft_query_start_loc = torch.cat((torch.zeros(1), lens.cumsum(0))).int()
        batches.append(batch)
    batches.append(planning_batch(**{key: values[1:] for key, values in ROWS.items()}))
    return [to_device(batch, device) for batch in batches]


def run(options: dict, device: torch.device, kernels: bool) -> dict:
    planner = make_planner(options, device, kernels)
    views = []
    for batch in steps(device):
        view = planner.plan(batch)
        # Copies: on CPU the rows are views of the planner's staging buffers,
        # which later steps overwrite.
        views.append(None if view is None else {
            "block_table": view.block_table.cpu().clone(),
            "removed_tokens": view.removed_tokens.cpu().clone(),
            "kept_context_lens": view.kept_context_lens.cpu().clone(),
            "rewrites": [(r.rows.cpu().clone(), r.max_context_len) for r in view.rewrites],
        })
    metrics = planner.metrics_snapshot()
    return {"views": views, "scores": planner._score_sums.cpu(),
            "metrics": {k: v for k, v in metrics.items() if k != "requests"},
            "requests": metrics["requests"]}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    return interpreted_results("tests.retrieval.test_planner_kernels", tmp_path_factory.mktemp("triton-interpreter")
                               / "planner.pt")




@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_planner_on_kernels_plans_what_it_plans_on_torch(name, device, request):
    if device == "cuda":
        got = run(OPTIONS[name], torch.device("cuda"), kernels=True)
    else:
        got = request.getfixturevalue("interpreted")[name]
    want = run(OPTIONS[name], torch.device("cpu"), kernels=False)
    assert sum(view is not None for view in want["views"]) >= 4
    for step, (kernel_view, torch_view) in enumerate(zip(got["views"], want["views"])):
        assert (kernel_view is None) == (torch_view is None), step
        if torch_view is None:
            continue
        for field in ("block_table", "removed_tokens", "kept_context_lens"):
            assert torch.equal(kernel_view[field], torch_view[field]), (name, step, field)
        assert len(kernel_view["rewrites"]) == len(torch_view["rewrites"])
        for (rows, length), (want_rows, want_length) in zip(kernel_view["rewrites"],
                                                            torch_view["rewrites"]):
            assert torch.equal(rows, want_rows) and length == want_length
    torch.testing.assert_close(got["scores"], want["scores"], rtol=1e-5, atol=1e-7)
    assert got["metrics"] == want["metrics"] and got["requests"] == want["requests"]
    # Something was removed and recorded: the comparison is not between two no-ops.
    assert want["metrics"]["kept_tokens"] < want["metrics"]["context_tokens"]


if __name__ == "__main__":  # the interpreter worker (TRITON_INTERPRET=1)
    torch.save({name: run(options, torch.device("cpu"), kernels=True)
                for name, options in OPTIONS.items()}, sys.argv[1])


def test_a_request_in_a_freed_slot_scores_from_zero():
    """Accepted-token scoring sums a request's chunk scores over the steps
    between its retrievals, in its slot: a request that leaves mid-way leaves
    them there, and the next request in that slot must not start from them.
    Torch path (the reset is the planner's, on either path). Mutation:
    forgetting a request without zeroing its slot's sums fails it."""
    options = {"mode": "cmr", "score_aggregation": "accepted_tokens"}
    cpu = torch.device("cpu")

    def new_requests_view(first_steps: list[list[str]]):
        planner = make_planner(options, cpu, kernels=False)
        # Steps 1 and 2: "old" retrieves, then sums its scores (interval 2).
        for ids, context_len in zip(first_steps, (3000, 3004)):
            planner.plan(planning_batch(ids, [K + 1] * len(ids), [context_len] * len(ids),
                                        [1000] * len(ids)))
        # Step 3: "new" (row 0) takes the slot "old" (row 1) left.
        view = planner.plan(planning_batch(["new", "a"], [K + 1] * 2, [2000, 3008], [1000] * 2))
        assert planner.tracked_requests()["new"] == 1
        return view.block_table[0], view.removed_tokens[0]

    reused = new_requests_view([["a", "old"]] * 2)
    fresh = new_requests_view([["a"]] * 2)
    assert torch.equal(reused[0], fresh[0]) and torch.equal(reused[1], fresh[1])
