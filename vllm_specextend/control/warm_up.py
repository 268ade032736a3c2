"""Goodput control's compiled loops, compiled (or loaded from numba's cache)
before an engine's first step, so that no step waits for a compilation.

Not a list of the loops and their argument types to keep up by hand: a
throwaway controller runs a short scripted engine through every kind of
step (arrivals with and without prefix cache hits, prompt chunks, paused
steps, probes, drafts on estimates, explorations, catch-ups cut short by the
token budget, departures), with the block tables of both dtypes vLLM and the
tests hand it, so whatever a step calls is compiled for what it passes.
``tests/common/test_compiled.py`` checks that a random engine run afterwards
compiles nothing.
"""

from __future__ import annotations

import numpy as np

from vllm_specextend.control.parameters import ControlParameters
from vllm_specextend.control.speculation_control import SpeculationControl

_WARMED = False


def warm_up_control() -> None:
    """Compile goodput control's loops once per process (see the module)."""
    global _WARMED
    if _WARMED:
        return
    _WARMED = True
    # Short intervals, so that probes and explorations come within the run.
    parameters = ControlParameters(probe_interval=2, explore_interval=6, probe_budget=1.0)
    for table_dtype in (np.int32, np.int64):
        for free_pause in (True, False):
            control = SpeculationControl(
                4, 2, free_pause=free_pause, synced_lead=1, max_catch_up=8,
                defer_prompts=True, parameters=parameters)
            _scripted_run(control, table_dtype)


def _scripted_run(control, table_dtype) -> None:
    """Forty steps of three requests: prompt chunks, decode steps whose
    drafts are accepted, then rejected (pauses, probes), departures and
    arrivals that hit the blocks of earlier ones (stale blocks)."""
    clock = [0.0]
    control.clock = lambda: clock[0]
    rng = np.random.default_rng(0)
    prompts = {"a": 40, "b": 24, "c": 8}
    context = {"a": 0, "b": 0, "c": 0}
    tables = {"a": [1, 2, 3, 4, 5, 6, 7, 8], "b": [9, 10, 11, 12, 13, 14, 15, 16],
              "c": [1, 2, 17, 18, 19, 20, 21, 22]}
    query = {req: min(prompts[req], 16) for req in prompts}
    accept = 1.0
    for step in range(40):
        if step == 20:
            accept = 0.0
        if step == 28:  # "a" leaves, "d" arrives on "a"'s first blocks
            for store in (prompts, context, tables, query):
                store.pop("a")
            prompts["d"], context["d"], query["d"] = 24, 16, 8
            tables["d"] = [1, 2, 3, 23, 24, 25, 26, 27]
        req_ids = list(prompts)
        table = np.array([tables[r] for r in req_ids], dtype=table_dtype)
        plan = control.plan_step(req_ids, np.array([context[r] for r in req_ids]),
                                 np.array([query[r] for r in req_ids]),
                                 np.array([prompts[r] for r in req_ids]), table, 4)
        if plan.runs_draft_forward:
            control.catch_up_starts(req_ids, np.array([context[r] for r in req_ids]),
                                    4 if step % 3 else 10_000)
        clock[0] += 0.05 + 0.01 * plan.draft_steps + 0.001 * rng.random()
        for row, req in enumerate(req_ids):
            if context[req] < prompts[req]:
                context[req] += query[req]
            else:
                drafted = query[req] - 1
                context[req] += 1 + (drafted if accept else 0)
            left = prompts[req] - context[req]
            query[req] = min(left, 16) if left > 0 else 1 + int(plan.draft_lengths[row])
    control.controller.finish(list(prompts))
