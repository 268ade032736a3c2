"""Goodput control's every decision over random step sequences, to compare
two versions of the code: a refactoring must leave the decisions identical
(and, unless it changes arithmetic, every number bit for bit).

Simulated engines (a clock from a random step-cost model with noise and
stalls, random acceptance, arrivals, departures, preemptions, prefix-sharing
block tables, catch-up budgets; batch 1 to 256, K 1 to 10, with and without
FULL CUDA graphs, heads and draft models) drive ``SpeculationControl``; each
step's plan (draft lengths, draft steps, expected goodput, catch-up limits,
prompt deferral), whether the draft's forward runs, the catch-up starts, and
at the end the metrics and the cost model's weights are recorded.

    python -m benchmarks.control_decisions --out /tmp/new.pkl   # this checkout
    git worktree add /tmp/old <commit>   # then, in /tmp/old:
    python -m benchmarks.control_decisions --out /tmp/old.pkl
    python -m benchmarks.control_decisions --compare /tmp/old.pkl /tmp/new.pkl

Only ``SpeculationControl``'s constructor, ``plan_step`` (before it,
``plan``), ``catch_up_starts``, ``draft_lengths``, ``metrics_snapshot`` and
``controller.cost.weights`` are used, so older versions run it too.
"""

from __future__ import annotations

import argparse
import pickle

import numpy as np

from vllm_specextend.control.speculation_control import SpeculationControl

BLOCK_SIZE = 16
TABLE_WIDTH = 64


def _plan(control, req_ids, ctx, query, prompt, table):
    """The step's plan and whether the draft's forward runs, from this
    checkout's ``plan_step`` or an older one's ``plan``."""
    if hasattr(control, "plan_step"):
        plan = control.plan_step(req_ids, ctx, query, prompt, table, BLOCK_SIZE)
        return plan, plan.runs_draft_forward
    return control.plan(req_ids, ctx, query, prompt, table, BLOCK_SIZE)


def scenario(seed: int, batch: int, k: int, steps: int, graphs: bool,
             max_catch_up: int | None, synced_lead: int, defer: bool, free_pause: bool,
             blocks: bool) -> tuple[list, dict, list]:
    """Every decision of one simulated engine."""
    rng = np.random.default_rng(seed)
    control = SpeculationControl(batch + 2, k, free_pause=free_pause, synced_lead=synced_lead,
                                 max_catch_up=max_catch_up, defer_prompts=defer,
                                 full_graph_query_len=(1 + k) if graphs else None)
    clock = [0.0]
    control.clock = lambda: clock[0]
    count = [0]

    def new_id() -> str:
        count[0] += 1
        return f"r{count[0]}"

    n = batch
    ids = [new_id() for _ in range(n)]
    prompt = rng.integers(20, 300, n)
    ctx = np.where(rng.random(n) < 0.5, prompt + rng.integers(0, 50, n), 0)
    query = np.where(ctx < prompt, prompt - ctx, 1)
    rates = rng.uniform(0.0, 1.0, n)
    ends = prompt + rng.integers(10, 300, n)
    base, per_token = rng.uniform(0.01, 0.1), rng.uniform(1e-4, 5e-3)
    per_draft, per_caught_up = rng.uniform(1e-3, 0.1), rng.uniform(0, 2e-3)
    decisions, tables = [], {}
    for _ in range(steps):
        req_ids = list(ids)
        table = None
        if blocks:
            table = np.zeros((len(req_ids), TABLE_WIDTH), dtype=np.int32)
            for row, req_id in enumerate(req_ids):
                if req_id not in tables:
                    first = 1000 + 100 * count[0]
                    mine = list(rng.integers(first, first + 90, TABLE_WIDTH))
                    if tables and rng.random() < 0.3:  # a prefix cache hit
                        other = tables[list(tables)[rng.integers(len(tables))]]
                        shared = int(rng.integers(1, 8))
                        mine[:shared] = other[:shared]
                    tables[req_id] = mine
                table[row] = tables[req_id]
        plan, runs = _plan(control, req_ids, ctx.copy(), query.copy(), prompt.copy(), table)
        starts, caught_up = None, 0
        if runs and free_pause:
            starts = control.catch_up_starts(req_ids, ctx.copy(),
                                             int(rng.choice([10_000, 50, 5])))
            if starts is not None:
                caught_up = int((ctx - starts).sum())
        limits = None if plan.catch_up_limits is None else plan.catch_up_limits.tolist()
        decisions.append((plan.draft_lengths.tolist(), plan.draft_steps,
                          float(plan.expected_goodput), limits, plan.draft_prefill, runs,
                          None if starts is None else starts.tolist(),
                          dict(control.draft_lengths)))
        noise = rng.lognormal(0, 0.1) * (10 if rng.random() < 0.01 else 1)  # stalls
        clock[0] += noise * (base + per_token * float(query.sum())
                             + (per_draft * plan.draft_steps if runs else 0)
                             + per_caught_up * caught_up)
        decoding = ctx >= prompt
        lengths = plan.draft_lengths if runs else np.zeros(n, np.int64)
        accepted = np.minimum(rng.geometric(np.clip(1 - rates, 1e-3, 1)) - 1, query - 1)
        ctx = ctx + np.where(decoding, accepted + 1, query)
        query = np.where(ctx < prompt, np.minimum(prompt - ctx, 128), lengths + 1)
        query = query.astype(np.int64)
        if rng.random() < 0.02:
            rates = rng.uniform(0, 1, n)
        for row in np.flatnonzero(ctx >= ends).tolist():
            ids[row] = new_id()
            prompt[row] = rng.integers(20, 300)
            ctx[row] = 0 if rng.random() < 0.7 else int(rng.integers(0, prompt[row]))
            query[row] = min(prompt[row] - ctx[row], 128)
            rates[row] = rng.uniform(0, 1)
            ends[row] = prompt[row] + rng.integers(10, 300)
        if rng.random() < 0.03 and n > 1:  # a request leaves
            keep = np.arange(n) != int(rng.integers(n))
            ids = [req_id for req_id, kept in zip(ids, keep) if kept]
            prompt, ctx, query, rates, ends = (a[keep] for a in (prompt, ctx, query, rates, ends))
            n -= 1
        if rng.random() < 0.03 and n < batch + 2:  # one arrives
            ids.append(new_id())
            length = int(rng.integers(20, 300))
            prompt, ctx = np.append(prompt, length), np.append(ctx, 0)
            query = np.append(query, min(length, 128))
            rates = np.append(rates, rng.uniform(0, 1))
            ends = np.append(ends, length + int(rng.integers(10, 300)))
            n += 1
        if rng.random() < 0.01:  # preempted: recomputed from an earlier point
            row = int(rng.integers(n))
            ctx[row] = max(int(ctx[row]) - 40, 0)
            query[row] = max(min(int(prompt[row] - ctx[row]), 128), 1)
    return decisions, control.metrics_snapshot(), control.controller.cost.weights.tolist()


def cases(count: int) -> list[dict]:
    chosen = []
    for seed in range(count):
        rng = np.random.default_rng(1000 + seed)
        case = dict(seed=seed, batch=int(rng.choice([1, 2, 4, 8, 32])), k=int(rng.integers(1, 5)),
                    steps=int(rng.choice([200, 600])), graphs=bool(rng.random() < 0.3),
                    max_catch_up=None if rng.random() < 0.6 else int(rng.integers(5, 60)),
                    synced_lead=int(rng.integers(0, 2)), defer=bool(rng.random() < 0.5),
                    free_pause=bool(rng.random() < 0.85), blocks=bool(rng.random() < 0.6))
        if seed % 10 == 9:
            case.update(batch=256, steps=150)
        if seed % 10 == 4:
            case.update(k=8 + seed % 3)  # numpy sums 8+ positions pairwise
        chosen.append(case)
    return chosen


GOODPUT = 2
"""A step's expected goodput among its recorded values (a float: arithmetic
changes move its last bits, not a decision)."""


def compare(old_path: str, new_path: str) -> int:
    """Prints the scenarios whose decisions differ (draft lengths and steps,
    catch-up limits, prompt deferral, whether the forward runs, catch-up
    starts), how many differ in any bit, and the largest relative change of
    an expected goodput; returns the number whose decisions differ."""
    with open(old_path, "rb") as f:
        old = pickle.load(f)
    with open(new_path, "rb") as f:
        new = pickle.load(f)
    differ = any_bit = 0
    largest = 0.0
    for key in old:
        (old_steps, *old_end), (new_steps, *new_end) = old[key], new[key]
        any_bit += old_steps != new_steps or old_end != new_end
        step = None
        for i, (a, b) in enumerate(zip(old_steps, new_steps)):
            if a[:GOODPUT] + a[GOODPUT + 1:] != b[:GOODPUT] + b[GOODPUT + 1:]:
                step = i
                break
            largest = max(largest, abs(a[GOODPUT] - b[GOODPUT]) / max(abs(a[GOODPUT]), 1e-30))
        if step is not None or old_end[0] != new_end[0]:  # decisions, metrics
            differ += 1
            print(f"decisions differ: {dict(key)} at step {step}")
    print(f"{len(old)} scenarios: {differ} with different decisions, {any_bit} different in "
          f"any bit (largest relative change of an expected goodput: {largest:.1e})")
    return differ


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", type=int, default=40)
    parser.add_argument("--out", help="where the decisions go (pickle)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args(argv)
    if args.compare:
        raise SystemExit(1 if compare(*args.compare) else 0)
    results = {tuple(sorted(case.items())): scenario(**case) for case in cases(args.scenarios)}
    with open(args.out, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main()
