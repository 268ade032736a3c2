"""Draft KV frontiers under goodput control (``retrieval/speculation_control.py``):
what each forward catches up when the plan limits it."""

import numpy as np

from vllm_specextend.core.goodput import UNLIMITED, DraftPlan
from vllm_specextend.retrieval.speculation_control import SpeculationControl

K = 3
BUDGET = 10_000  # the drafter's token budget: never binding here


class ScriptedControl:
    """Two requests, ``a`` and ``b``, prefilled to 100 tokens; each step plans
    the given drafts and catch-up limits and verifies one token per request."""

    def __init__(self):
        self.control = SpeculationControl(max_requests=2, num_speculative_tokens=K,
                                          free_pause=True)
        self.context = np.array([0, 0])
        self.step({"a": 0, "b": 0}, query=100)  # prefill: the forward runs

    def step(self, drafts: dict[str, int], limits: dict[str, int] | None = None,
             query: int = 1):
        req_ids = ["a", "b"]
        lengths = np.array([drafts[r] for r in req_ids])
        plan = DraftPlan(lengths, int(lengths.max()), 0.0,
                         None if limits is None else np.array([limits[r] for r in req_ids]))
        def scripted_plan(*args, catch_up_gaps):
            self.gaps = catch_up_gaps.tolist()
            return plan

        self.control.controller.plan = scripted_plan
        queries = np.full(2, query)
        _, runs = self.control.plan(req_ids, self.context, queries, np.full(2, 100))
        starts = (self.control.catch_up_starts(req_ids, self.context, BUDGET) if runs
                  else "skipped")
        self.context = self.context + queries
        return starts


def test_only_requests_drafting_on_their_estimates_catch_up_all_of_their_gap():
    scripted = ScriptedControl()
    # The prefill's forward wrote the draft KV up to position 100 (a draft
    # model's forward also writes the next token's).
    for _ in range(20):  # both paused: no forward
        assert scripted.step({"a": 0, "b": 0}) == "skipped"
    # "a" drafts on its estimates, "b" stays paused in the forward that runs:
    # "a" catches up its 19 tokens (101-119), "b" none.
    # (The controller is told the gaps: it prices a resumption's catch-up.)
    starts = scripted.step({"a": K, "b": 0}, {"a": UNLIMITED, "b": 0})
    assert starts.tolist() == [101, 120] and scripted.gaps == [19, 19]
    # "b" probes with a limit of 4: its 4 most recent tokens ("a" is synced).
    starts = scripted.step({"a": K, "b": 1}, {"a": UNLIMITED, "b": 4})
    assert starts.tolist() == [121, 117] and scripted.gaps == [0, 20]
    # "b" drafts on its estimates: all of its gap, from where it paused.
    starts = scripted.step({"a": K, "b": K}, {"a": UNLIMITED, "b": UNLIMITED})
    assert starts.tolist() == [122, 101] and scripted.gaps == [0, 21]
    # Both caught up: nothing lags.
    assert scripted.step({"a": K, "b": K}, {"a": UNLIMITED, "b": UNLIMITED}) is None
    assert scripted.control.controller.stats.catch_up_tokens == 19 + 4 + 21


def test_a_plan_without_limits_catches_every_row_up():
    scripted = ScriptedControl()
    for _ in range(5):
        scripted.step({"a": 0, "b": 0})
    starts = scripted.step({"a": K, "b": 0})
    assert starts.tolist() == [101, 101]
