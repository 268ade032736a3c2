"""Draft KV frontiers under goodput control (``control/speculation_control.py``):
what each forward catches up when the plan limits it."""

import numpy as np

from vllm_specextend.control.goodput import UNLIMITED, DraftPlan
from vllm_specextend.control.speculation_control import SpeculationControl

K = 3
BUDGET = 10_000  # the drafter's token budget: never binding here


class ScriptedControl:
    """Two requests, ``a`` and ``b``, prefilled to 100 tokens; each step plans
    the given drafts and catch-up limits and verifies one token per request."""

    def __init__(self):
        self.control = SpeculationControl(max_num_reqs=2, num_speculative_tokens=K,
                                          free_pause=True)
        self.context = np.array([0, 0])
        self.step({"a": 0, "b": 0}, query=100)  # prefill: the forward runs

    def step(self, drafts: dict[str, int], limits: dict[str, int] | None = None,
             query: int = 1):
        req_ids = ["a", "b"]
        lengths = np.array([drafts[r] for r in req_ids])
        plan = DraftPlan(lengths, int(lengths.max()), 0.0,
                         None if limits is None else np.array([limits[r] for r in req_ids]))
        def scripted_plan(*args, catch_up_gaps, **kwargs):
            self.gaps = catch_up_gaps.tolist()
            return plan

        self.control.controller.choose = scripted_plan
        queries = np.full(2, query)
        runs = self.control.plan_step(req_ids, self.context, queries,
                                      np.full(2, 100)).runs_draft_forward
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


BLOCK = 16


class BlockScript:
    """Requests with KV block ids, each step planned as given: ``rows`` maps a
    request to (computed tokens, query tokens, prompt length, block ids);
    requests drafting catch up all of their gap, the others none."""

    def __init__(self):
        self.control = SpeculationControl(max_num_reqs=4, num_speculative_tokens=K,
                                          free_pause=True, defer_prompts=True)
        self.whole_catch_up = None

    def step(self, rows: dict, drafts: dict | None = None, draft_prefill: bool = True,
             budget: int = BUDGET):
        req_ids = list(rows)
        context = np.array([rows[r][0] for r in req_ids])
        query = np.array([rows[r][1] for r in req_ids])
        prompt = np.array([rows[r][2] for r in req_ids])
        table = np.zeros((len(req_ids), 64), dtype=np.int32)
        for i, r in enumerate(req_ids):
            table[i, :len(rows[r][3])] = rows[r][3]
        lengths = np.array([(drafts or {}).get(r, 0) for r in req_ids])
        # As the controller limits them: a request drafting catches up all.
        limits = np.where(lengths > 0, UNLIMITED, 0)
        plan = DraftPlan(lengths, int(lengths.max()), 0.0, limits, draft_prefill)

        def scripted_plan(*args, catch_up_gaps, whole_catch_up):
            self.whole_catch_up = dict(zip(req_ids, whole_catch_up.tolist()))
            return plan

        self.control.controller.choose = scripted_plan
        runs = self.control.plan_step(req_ids, context, query, prompt, table,
                                      BLOCK).runs_draft_forward
        if not runs:
            return "skipped"
        starts = self.control.catch_up_starts(req_ids, context, budget)
        return None if starts is None else dict(zip(req_ids, starts.tolist()))


def test_a_deferred_prompt_is_caught_up_when_the_request_drafts_on_its_estimates():
    script = BlockScript()
    blocks = list(range(10, 17))  # 100 tokens
    # Nobody drafts and a new request would not: the prompt skips the draft.
    assert script.step({"a": (0, 100, 100, blocks)}, draft_prefill=False) == "skipped"
    assert script.control.controller.stats.deferred_prefill_tokens == 100
    for step in range(5):
        assert script.step({"a": (100 + step, 1, 100, blocks)}) == "skipped"
    # A probe must catch up all of it (with holes in the prompt it would
    # not measure the draft).
    assert script.whole_catch_up == {"a": True}
    # Drafting on its estimates: all of it, from the prompt's start.
    assert script.step({"a": (105, 1, 100, blocks)}, {"a": K}) == {"a": 0}
    assert script.step({"a": (106, 1 + K, 100, blocks)}, {"a": K}) is None
    assert script.whole_catch_up == {"a": False}
    # A prompt in a step whose plan lets it through runs the draft.
    assert script.step({"a": (110, 1, 100, blocks), "b": (0, 50, 50, [20, 21, 22, 23])}) \
        is None


def test_a_prefix_hit_on_blocks_without_draft_kv_catches_up_from_the_first():
    script = BlockScript()
    deferred = [10, 11, 12, 13, 14, 15, 16]
    script.step({"a": (0, 100, 100, deferred)}, draft_prefill=False)
    script.step({"a": (100, 1, 100, deferred)})
    # "b" hits "a"'s first four blocks while "a" lags: it starts behind, at 0.
    script.step({"a": (101, 1, 100, deferred), "b": (64, 36, 100, deferred[:4] + [30, 31, 32])})
    assert script.step({"a": (102, 1, 100, deferred), "b": (100, 1, 100, [])},
                       {"b": K})["b"] == 0
    # "a" finishes behind: its blocks turn stale for later hits, but for the
    # four "b" shares and wrote in its catch-up. "c" hits five of them.
    script.step({"b": (101, 1 + K, 100, deferred[:4] + [30, 31, 32])})
    script.step({"c": (80, 20, 100, deferred[:5] + [40, 41])})
    assert script.control.frontiers(["c"])[0] == 64
    # Written again (here by "c"'s catch-up), a block is right again.
    script.step({"c": (100, 1, 100, deferred[:5] + [40, 41])}, {"c": K})
    script.step({"c": (101, 1 + K, 100, deferred[:5] + [40, 41])})
    script.step({"e": (80, 20, 100, deferred[:5] + [50, 51])})
    assert script.control.frontiers(["e"])[0] == 80


def test_a_catch_up_cut_by_the_token_budget_leaves_its_older_blocks_stale():
    script = BlockScript()
    blocks = list(range(10, 17))
    script.step({"a": (0, 100, 100, blocks)}, draft_prefill=False)
    # The drafter's budget lets it catch up its 40 most recent tokens (60-99).
    assert script.step({"a": (100, 1, 100, blocks)}, {"a": K}, budget=40) == {"a": 60}
    script.step({"a": (101, 1 + K, 100, blocks)})
    script.step({"b": (64, 36, 100, blocks[:4] + [20, 21, 22])})
    assert script.control.frontiers(["b"])[0] == 0


def test_the_runner_keeps_each_requests_planned_drafts_in_any_row_order():
    from vllm_specextend.patches import _keep_planned_drafts

    scripted = ScriptedControl()
    scripted.step({"a": 2, "b": 0})
    lengths = scripted.control.draft_lengths
    assert dict(lengths) == {"a": 2, "b": 0} and lengths["a"] == 2 and len(lengths) == 2
    assert lengths.rows(["b", "a", "c"]) == [0, 2, None]

    class Drafter:  # an adapter's answer (drafters/features.py)
        def planned_draft_lengths(self):
            return scripted.control.draft_lengths

    class Runner:
        drafter = Drafter()

    def stock(runner):
        return [[1, 2, 3]] * len(runner.req_ids), runner.req_ids

    kept = _keep_planned_drafts(stock)
    for req_ids in (["a", "b"], ["b", "a", "c"]):
        Runner.req_ids = req_ids
        drafts, _ = kept(Runner())
        # A request the plan did not see keeps its drafts.
        assert drafts == [{"a": [1, 2], "b": [], "c": [1, 2, 3]}[r] for r in req_ids]
