"""How far interleaved rounds resolve a speed ratio: for each configuration of
a batch run with ``--rounds``, its paired ratio to the target alone (the
median over rounds of this round's speed over the target's), a bootstrap
interval of that median, and the rounds a ``--floor`` test would need at the
rounds' spread.

    python -m benchmarks.round_spread benchmarks/results/<run>/results.json ...
        [--target benchmarks/results/<target run>/results.json]

(seconds; reads the recorded rounds, runs nothing). ``--target``: the target
alone ran in its own invocation (two float32 engines do not fit in 24 GiB):
the rounds are not paired, so the ratio is of the two medians and its
interval resamples both runs' rounds.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

LEVEL = 0.9
"""The interval's coverage (two-sided)."""
RESAMPLES = 10_000


def median_interval(ratios: list[float], level: float = LEVEL,
                    resamples: int = RESAMPLES) -> tuple[float, float]:
    """A ``level`` bootstrap interval of the median of ``ratios`` (percentile
    method, a fixed seed: the same rounds give the same interval)."""
    values = np.asarray(ratios, dtype=np.float64)
    rng = np.random.default_rng(0)
    medians = np.median(values[rng.integers(0, len(values), (resamples, len(values)))], axis=1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(low), float(high)


def unpaired_interval(rounds: list[float], target_rounds: list[float], level: float = LEVEL,
                      resamples: int = RESAMPLES) -> tuple[float, float]:
    """A ``level`` bootstrap interval of median(``rounds``) / median(``target_rounds``),
    each run's rounds resampled on their own (a fixed seed)."""
    rng = np.random.default_rng(0)

    def medians(values: list[float]) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        return np.median(values[rng.integers(0, len(values), (resamples, len(values)))], axis=1)

    ratios = medians(rounds) / medians(target_rounds)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


def rounds_to_resolve(ratios: list[float], margin: float) -> int | None:
    """Rounds whose mean ratio's 90% interval is ``margin`` wide on each side,
    at these rounds' spread (a normal approximation; None: one round)."""
    if len(ratios) < 2:
        return None
    spread = float(np.std(ratios, ddof=1))
    return math.ceil((1.645 * spread / margin) ** 2)


def spread_rows(results: dict, margin: float, target_results: dict | None = None) -> list[str]:
    """One markdown row per configuration with rounds and a target alone to
    pair with (``target_results``: the target alone's own run, unpaired)."""
    measurements = results["measurements"]
    targets = {(m["batch_size"], m["context_tokens"]): m
               for m in (target_results or results)["measurements"] if m["config"] == "target"}
    rows = []
    for m in measurements:
        target = targets.get((m["batch_size"], m["context_tokens"]))
        if m["config"] == "target" or target is None or not m.get("round_tok_s"):
            continue
        if target_results is None:
            ratios = (np.asarray(m["round_tok_s"]) / np.asarray(target["round_tok_s"])).tolist()
            ratio, (low, high) = float(np.median(ratios)), median_interval(ratios)
        else:
            target_median = float(np.median(target["round_tok_s"]))
            ratios = (np.asarray(m["round_tok_s"]) / target_median).tolist()
            ratio = float(np.median(m["round_tok_s"])) / target_median
            low, high = unpaired_interval(m["round_tok_s"], target["round_tok_s"])
        needed = rounds_to_resolve(ratios, margin)
        rows.append(f"| {m['config']} | {m['batch_size']} | {m['context_tokens']} | "
                    f"{ratio:.3f} | {low:.3f}-{high:.3f} | "
                    f"{np.std(ratios, ddof=1):.3f} | {len(ratios)} | {needed} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.json of batch runs with --rounds")
    parser.add_argument("--target", default=None,
                        help="results.json of the target alone's own run (unpaired rounds)")
    parser.add_argument("--floor", type=float, default=0.97,
                        help="the ratio to tell from 1.0 (default 0.97: rounds to resolve 3%%)")
    args = parser.parse_args()
    margin = 1.0 - args.floor
    target_results = None
    if args.target:
        with open(args.target) as f:
            target_results = json.load(f)
    versus = "paired vs target" if target_results is None else "vs target (medians)"
    print(f"| run | config | batch | context | {versus} | {LEVEL:.0%} interval | "
          f"round sd | rounds | rounds to resolve {margin:.0%} |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|")
    for path in args.results:
        with open(path) as f:
            results = json.load(f)
        name = path.rstrip("/").split("/")[-2]
        for row in spread_rows(results, margin, target_results):
            print(f"| {name} {row}")


if __name__ == "__main__":
    main()
