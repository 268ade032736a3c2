"""Retrieval keeps what the target's attention picks: "needles", keys in
chosen chunks of the tap's key buffer that every query of the target's last
layer attends to, are kept at every step of every decode row, and wherever
they move the kept blocks follow at the next retrieval; with accepted-token
scores, each retrieval starts its sums over.

The expected views are built from the needles' places alone (sink + needle
chunks + recent window, ``rewrite_block_table``), not from the planner's own
scores, so a planner that keeps the earliest, the latest or random chunks,
or never scores its decode rows, fails. The torch path runs here; the
kernels (``use_kernels``) under Triton's interpreter in one worker process
(``tests/triton_interpreter.py``), with CUDA also on the device. Only
``RetrievalPlanner.plan`` is called: the kernels behind it may change.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.retrieval.test_planner import BLOCK_SIZE, K, planning_batch, to_device
from tests.triton_interpreter import DEVICES, interpreted_results
from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.retrieval.kernels.scoring import ScoringWorkspace
from vllm_specextend.retrieval.kernels.selection import rewrite_block_table
from vllm_specextend.retrieval.planner import RetrievalPlanner
from vllm_specextend.retrieval.target_tap import TargetAttentionTap

pytestmark = pytest.mark.interpreter  # Triton's interpreter in a worker process

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
CHUNK = 32
SINK, RECENT, TOP_K = 16, 64, 2
MAX_BLOCKS = 128
MAX_MODEL_LEN = MAX_BLOCKS * BLOCK_SIZE
STEPS = 5
"""Steps of K + 1 accepted tokens; retrievals (interval 2) at steps 0, 2 and 4."""
CONTEXTS = {"a": 700, "b": 560}
NEEDLES = {"a": ([4, 13], [8, 16]), "b": ([9, 12], [3, 6])}
"""Needle chunks of each request before step 3, and from step 3 on."""
MOVED_AT = 3
AGGREGATIONS = ["last_token", "accepted_tokens"]
RESET_CONTEXTS = {"a": 700}
X_CHUNKS, Y_CHUNKS = [3, 14], [7, 17]
"""The reset test's needles: X draws the first step, Y the next ones."""


def make_planner(device: torch.device, kernels: bool, **options) -> RetrievalPlanner:
    config = SpecExtendConfig(mode="cmr", min_context_tokens=512, sink_tokens=SINK,
                              recent_tokens=RECENT, chunk_size=CHUNK, top_k_chunks=TOP_K,
                              retrieval_interval=2, **options)
    planner = RetrievalPlanner(config, max_num_reqs=4, max_model_len=MAX_MODEL_LEN,
                               max_num_speculative_tokens=K, draft_window=MAX_MODEL_LEN,
                               compact_positions=False, device=device)
    planner.use_kernels = kernels
    planner.scoring_workspace = ScoringWorkspace.allocate(
        HEADS, KV_HEADS, HEAD_DIM, 4, K + 1, torch.float32, device, use_kernel=kernels,
        max_context_len=MAX_MODEL_LEN)
    tap = TargetAttentionTap(num_slots=4 * MAX_BLOCKS * BLOCK_SIZE, max_num_tokens=64,
                             num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             scale=HEAD_DIM ** -0.5, dtype=torch.float32, device=device)
    planner.bind_kv_cache(tap, BLOCK_SIZE)
    return planner


def directions(count: int) -> torch.Tensor:
    """``count`` orthonormal directions of a head's space."""
    generator = torch.Generator().manual_seed(7)
    return torch.linalg.qr(torch.randn(HEAD_DIM, count, generator=generator))[0].T


def plant(tap: TargetAttentionTap, row: int, chunks: list[int], direction: torch.Tensor,
          strength: float = 4.0) -> None:
    """Keys along ``direction`` (every KV head) on the chunks of batch row
    ``row`` (its blocks are ``row * MAX_BLOCKS + i``, ``planning_batch``)."""
    for chunk in chunks:
        start = (row * MAX_BLOCKS) * BLOCK_SIZE + chunk * CHUNK
        tap.keys[start:start + CHUNK] = strength * direction.to(tap.keys.device)


def fill(tap: TargetAttentionTap, seed: int, direction: torch.Tensor | None = None,
         strength: float = 0.0, keys: bool = False) -> None:
    """Random queries (std 0.5) pointing along ``direction`` by ``strength``,
    and with ``keys`` random keys (std 1)."""
    generator = torch.Generator().manual_seed(seed)
    if keys:
        tap.keys.copy_(torch.randn(tap.keys.shape, generator=generator))
    queries = 0.5 * torch.randn(tap.queries.shape, generator=generator)
    if direction is not None:
        queries += strength * direction
    tap.queries.copy_(queries)


def step_batch(step: int, device: torch.device, contexts: dict[str, int] = CONTEXTS):
    rows = list(contexts)
    return to_device(planning_batch(rows, [K + 1] * len(rows),
                                    [contexts[r] + (K + 1) * step for r in rows],
                                    [500] * len(rows), max_blocks=MAX_BLOCKS), device)


def view_of(view) -> dict:
    # Copies: on CPU the view's rows may be the planner's staging buffers.
    return {"block_table": view.block_table.cpu().clone(),
            "removed_tokens": view.removed_tokens.cpu().clone()}


def needle_views(aggregation: str, device: torch.device, kernels: bool) -> list[dict]:
    """The views of ``STEPS`` steps of the two requests, their needles moved
    before step ``MOVED_AT``."""
    planner = make_planner(device, kernels, score_aggregation=aggregation)
    tap = planner.tap
    needle = directions(1)[0]
    fill(tap, seed=0, keys=True)
    views = []
    for step in range(STEPS):
        if step == MOVED_AT:
            fill(tap, seed=100, keys=True)
        for row, request in enumerate(CONTEXTS):
            plant(tap, row, NEEDLES[request][step >= MOVED_AT], needle)
        fill(tap, seed=step + 1, direction=needle, strength=2.0)
        views.append(view_of(planner.plan(step_batch(step, device))))
    return views


def expected_view(step: int, chunks_of: dict[str, list[int]], retrieval_step: int,
                  contexts: dict[str, int] = CONTEXTS) -> dict:
    """Sink, the needle chunks and the recent window of the last retrieval,
    nothing else, rewritten as ``rewrite_block_table`` does."""
    batch = step_batch(step, torch.device("cpu"), contexts)
    keep = torch.zeros_like(batch.block_table, dtype=torch.bool)
    for row, request in enumerate(contexts):
        first_query = contexts[request] + (K + 1) * retrieval_step
        keep[row, :-(-SINK // BLOCK_SIZE)] = True
        keep[row, (first_query - RECENT) // BLOCK_SIZE:] = True
        for chunk in chunks_of[request]:
            blocks = CHUNK // BLOCK_SIZE
            keep[row, chunk * blocks:(chunk + 1) * blocks] = True
    table, removed = rewrite_block_table(batch.block_table, keep, BLOCK_SIZE)
    return {"block_table": table, "removed_tokens": removed}


def assert_needles_kept(views: list[dict]) -> None:
    for step, view in enumerate(views):
        retrieval_step = step - step % 2
        moved = retrieval_step >= MOVED_AT
        want = expected_view(step, {r: NEEDLES[r][moved] for r in CONTEXTS}, retrieval_step)
        for field in ("block_table", "removed_tokens"):
            assert torch.equal(view[field], want[field]), (step, field)


def reset_views(refresh: str) -> dict:
    """Accepted-token scores, one request: needle X draws step 0's queries
    hard, needle Y steps 1 and 2's mildly; the retrieval at step 2 (its
    second) is compared with a fresh planner's whose first step looked for
    nothing and whose next steps were these."""
    x_direction, y_direction = directions(2)
    cpu = torch.device("cpu")

    def run(first_direction):
        planner = make_planner(cpu, kernels=False, score_aggregation="accepted_tokens",
                               retrieval_refresh=refresh)
        fill(planner.tap, seed=0, keys=True)
        plant(planner.tap, 0, X_CHUNKS, x_direction)
        plant(planner.tap, 0, Y_CHUNKS, y_direction)
        views = []
        for step in range(3):
            direction, strength = (first_direction, 4.0) if step == 0 else (y_direction, 1.5)
            fill(planner.tap, seed=step + 1, direction=direction, strength=strength)
            views.append(view_of(planner.plan(step_batch(step, cpu, RESET_CONTEXTS))))
        return views

    return {"continued": run(x_direction), "fresh": run(None)}


# ---- the worker: the kernels under Triton's interpreter ---------------------

def kernel_results(device: torch.device) -> list[dict]:
    # Accepted-token scores only (the interpreter takes ~30 s a run): they
    # score every row at every step and start over at each retrieval; the
    # last-token path's kernels plan what torch plans (test_planner_kernels).
    return needle_views("accepted_tokens", device, kernels=True)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    return interpreted_results("tests.retrieval.test_needles",
                               tmp_path_factory.mktemp("triton-interpreter") / "needles.pt")


def kernel_run(device: str, request) -> list[dict]:
    if device == "cuda":
        return kernel_results(torch.device("cuda"))
    return request.getfixturevalue("interpreted")


# ---- the tests ---------------------------------------------------------------

@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_needle_chunks_are_kept_at_every_step_and_follow_the_needles(aggregation):
    """Mutations that fail it: decode rows never scored (the earliest chunks
    kept); the planner ranking chunks by position (the latest), by zeros
    (the earliest) or at random."""
    assert_needles_kept(needle_views(aggregation, torch.device("cpu"), kernels=False))


@pytest.mark.parametrize("device", DEVICES)
def test_needle_chunks_are_kept_on_the_kernels(device, request):
    """Mutations that fail it: as above, on the kernels (the selection
    kernel given zeros or random scores, or ranking by position); a
    retrieval not resetting accepted-token sums (the old needles stay)."""
    views = kernel_run(device, request)
    assert_needles_kept([{k: v.cpu() for k, v in view.items()} for view in views])


def assert_scores_started_over(views: dict) -> None:
    continued, fresh = views["continued"], views["fresh"]
    # The first retrieval kept X, the needle step 0 looked for.
    want_x = expected_view(0, {"a": X_CHUNKS}, 0, RESET_CONTEXTS)
    assert torch.equal(continued[0]["block_table"], want_x["block_table"])
    # The second keeps Y, as the fresh planner does: step 0's sums are gone.
    want_y = expected_view(2, {"a": Y_CHUNKS}, 2, RESET_CONTEXTS)
    for view in (continued[2], fresh[2]):
        for field in ("block_table", "removed_tokens"):
            assert torch.equal(view[field], want_y[field]), field


@pytest.mark.parametrize("refresh", ["interval", "acceptance"])
def test_accepted_token_scores_start_over_at_each_retrieval(refresh):
    """Mutation that fails it: a retrieval not resetting its slot's score
    sums (the second retrieval keeps X, step 0's needle). On the kernels the
    accepted-token needle test fails under it."""
    assert_scores_started_over(reset_views(refresh))


if __name__ == "__main__":  # the interpreter worker (TRITON_INTERPRET=1)
    torch.save(kernel_results(torch.device("cpu")), sys.argv[1])
