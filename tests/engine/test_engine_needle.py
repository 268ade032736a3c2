"""Engine test: a model on which retrieval matters, so that a wrong selection
fails an engine run.

The needle model (``tests/tiny_models.py``, built by hand) answers each
prompt with the token its one needle names, at every step, and with a filler
token when no needle is in view; its last (only) attention layer draws every
query to the needle. Drafting with itself, a draft accepts everything when
its view keeps the needle's chunk and nothing when it does not: cmr keeps
it (the target's attention points at it), streaming (sink + latest chunks)
cannot. One engine serves cmr at the last token, cmr over the accepted
tokens and streaming (``reconfigure_drafter``); a worker hook records, at
every step whose view compacts a row, the blocks kept (by their place in the
context) and the needle's block.
"""

import pytest

from benchmarks.worker_hooks import reconfigure_drafter
from tests.engine_utils import (
    SMALL_CACHE,
    counter_deltas,
    engine,
    generate_greedy,
    spec_decode_counters,
)
from tests.tiny_models import ANSWER_TOKENS, build_needle_model, needle_prompt

pytestmark = pytest.mark.engine

MAX_TOKENS = 32
K = 3
BLOCK_SIZE = 32  # DEFAULT_ENGINE_KWARGS; chunks of one block
LENGTH = 1500
DEPTHS = (200, 500, 900, 1200)
"""Needle positions, one prompt each: blocks 6, 15, 28 and 37, all before
the recent window (from block 44 on) and after the sink (block 0)."""
OPTIONS = {**SMALL_CACHE, "top_k_chunks": 1}
"""One chunk retrieved: the view keeps the sink, one chunk, the recent window."""
CONFIGS = {"cmr": (OPTIONS, MAX_TOKENS),
           "cmr-accepted-tokens": ({**OPTIONS, "score_aggregation": "accepted_tokens"},
                                   MAX_TOKENS),
           # Fewer tokens: rejecting every draft, it takes a step per token.
           "streaming": ({**OPTIONS, "mode": "streaming"}, 12)}
"""Options and tokens generated per configuration."""


def watch_kept_needles(worker) -> None:
    """At every plan whose view compacts a row, record per such row its
    needle's block, the blocks its view keeps (their places in the context)
    and its context's blocks."""
    import numpy as np

    from tests.tiny_models import NEEDLE_TOKENS

    runner = worker.model_runner
    retrieval = runner.drafter.retrieval
    records = runner.drafter._test_needles = []
    plan = retrieval.plan

    def watched(batch):
        view = plan(batch)
        if view is None:
            return view
        removed, seq_lens = view.removed_tokens.tolist(), batch.seq_lens.tolist()
        block_size = retrieval.block_size
        for row in range(batch.num_reqs):
            if removed[row] == 0:
                continue
            prompt = runner.input_batch.token_ids_cpu[row, :batch.prompt_lens_cpu[row]]
            needle = int(np.flatnonzero(np.isin(prompt, NEEDLE_TOKENS))[0])
            blocks = -(-seq_lens[row] // block_size)
            place = {block: i for i, block in enumerate(batch.block_table[row, :blocks].tolist())}
            kept = view.block_table[row, :blocks - removed[row] // block_size].tolist()
            records.append((needle // block_size, [place[block] for block in kept], blocks))
        return view

    retrieval.plan = watched


def kept_needles(worker) -> list:
    """``watch_kept_needles``' records since the last call."""
    records = worker.model_runner.drafter._test_needles
    taken = list(records)
    records.clear()
    return taken


@pytest.fixture(scope="module")
def needle_runs():
    """Per configuration: outputs, vLLM's spec-decode counters, the records."""
    model = build_needle_model()
    prompts = [needle_prompt(LENGTH, i, depth, seed=i) for i, depth in enumerate(DEPTHS)]
    runs = {}
    with engine(model, model, k=K, spec_extend=OPTIONS, max_model_len=2048) as llm:
        llm.collective_rpc(watch_kept_needles)
        for name, (options, max_tokens) in CONFIGS.items():
            llm.collective_rpc(reconfigure_drafter, args=(options,))
            before = spec_decode_counters(llm)
            outputs = generate_greedy(llm, prompts, max_tokens)
            runs[name] = ([list(o.outputs[0].token_ids) for o in outputs],
                          counter_deltas(spec_decode_counters(llm), before),
                          llm.collective_rpc(kept_needles)[0])
    return runs


def outside_recent_window(kept: list[int], blocks: int) -> set[int]:
    """The kept blocks before the run of kept blocks that ends the context."""
    start = blocks
    while start - 1 in kept:
        start -= 1
    return {block for block in kept if block < start}


@pytest.mark.parametrize("name", ["cmr", "cmr-accepted-tokens"])
def test_cmr_keeps_each_needle_at_every_step_and_accepts_every_draft(needle_runs, name):
    """Mutations that fail it: decode rows never scored (the earliest chunk
    kept), the planner ranking chunks by zeros, by position or at random."""
    token_ids, counters, records = needle_runs[name]
    assert token_ids == [[ANSWER_TOKENS[i]] * MAX_TOKENS for i in range(len(DEPTHS))]
    # Measured: 96 of 96 drafts accepted, 32 compacted row steps (both).
    assert counters["num_accepted_tokens"] >= 0.9 * counters["num_draft_tokens"] > 0
    assert len(records) >= 28
    for needle_block, kept, blocks in records:
        assert outside_recent_window(kept, blocks) == {0, needle_block}, (needle_block, kept)
    # Each prompt's needle sits elsewhere, and so do the blocks kept.
    assert {needle for needle, _, _ in records} == {depth // BLOCK_SIZE for depth in DEPTHS}


def test_streaming_misses_the_needles_and_accepts_almost_nothing(needle_runs):
    token_ids, counters, records = needle_runs["streaming"]
    assert token_ids == [ids[:12] for ids in needle_runs["cmr"][0]]
    # Measured: 12 of 96 drafts accepted: the K drafts each request made at
    # its prefill step, over the whole prompt; none after (cmr: all 96 of 96).
    assert counters["num_accepted_tokens"] <= K * len(DEPTHS)
    assert counters["num_draft_tokens"] >= 80
    assert records and all(needle not in kept for needle, kept, _ in records)
