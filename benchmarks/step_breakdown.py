"""Where a decode step's time goes, measured inside the engine's worker
(shipped there through ``collective_rpc``): the period from one step's
``execute_model`` to the next's, and within it the runner's parts, the
drafter, goodput control, retrieval and the target tap. What the worker does
not spend in the step's calls is the engine core's (scheduling, output
processing) and the inter-process round trips; with the synchronous
scheduler and a drafter, vLLM adds one more round trip a step
(``take_draft_token_ids``).

Only decode steps count (no row with more than ``1 + K`` query tokens), and
a period only when the step before it was a decode step too.
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

RUNNER_PARTS = (
    ("execute_model", "execute_model"),
    ("update_states", "_update_states"),
    ("prepare_inputs", "_prepare_inputs"),
    ("target_forward", "_model_forward"),
    ("sample_tokens", "sample_tokens"),
    ("sample", "_sample"),
    ("bookkeeping", "_bookkeeping_sync"),
    ("propose", "propose_draft_token_ids"),
    ("take_draft_token_ids", "take_draft_token_ids"),
)
"""(label, ``GPUModelRunner`` method) timed on the runner instance."""
PARTS = ("period", *(label for label, _ in RUNNER_PARTS), "target_attention", "drafter_propose",
         "control_plan", "catch_up", "retrieval_plan", "tap")
"""Every timer, in seconds summed over decode steps (``period``: between two
decode steps' ``execute_model`` calls)."""


def install_step_breakdown(worker) -> None:
    """Time the parts of every decode step from now on (idempotent)."""
    runner = worker.model_runner
    if getattr(runner, "_step_breakdown", None) is not None:
        return
    spec = runner.vllm_config.speculative_config
    max_decode_tokens = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    totals = {part: 0.0 for part in PARTS} | {"steps": 0, "periods": 0}
    state = {"decode": False, "last_start": None}
    runner._step_breakdown = totals

    def timed(owner, name: str, label: str, starts_step: bool = False) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            if starts_step:
                scheduled = (args[0] if args else kwargs["scheduler_output"]).num_scheduled_tokens
                decode = bool(scheduled) and max(scheduled.values()) <= max_decode_tokens
                if decode and state["decode"] and state["last_start"] is not None:
                    totals["period"] += start - state["last_start"]
                    totals["periods"] += 1
                state["decode"], state["last_start"] = decode, start
                totals["steps"] += decode
            try:
                return original(*args, **kwargs)
            finally:
                if state["decode"]:
                    totals[label] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    for label, name in RUNNER_PARTS:
        timed(runner, name, label, starts_step=name == "execute_model")
    for module in runner.model.modules():
        impl = getattr(module, "impl", None)
        if impl is not None and hasattr(impl, "forward") and hasattr(module, "layer_name"):
            timed(impl, "forward", "target_attention")
    drafter = getattr(runner, "drafter", None)
    if drafter is None:
        return
    timed(drafter, "propose", "drafter_propose")
    control = getattr(drafter, "control", None)
    if control is not None:
        timed(control, "plan", "control_plan")
        timed(control, "catch_up", "catch_up")
    retrieval = getattr(drafter, "retrieval", None)
    if retrieval is not None:
        timed(retrieval, "plan", "retrieval_plan")
        tap = getattr(retrieval, "tap", None)
        if tap is not None:
            timed(tap, "record_queries", "tap")
            timed(tap, "record_keys", "tap")


def read_step_breakdown(worker) -> dict[str, Any]:
    return dict(worker.model_runner._step_breakdown)


def breakdown_per_step(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Milliseconds per decode step of each part between two readings
    (``period`` per period; ``outside_worker``: the period less the step's
    calls into the worker)."""
    steps = after["steps"] - before["steps"]
    periods = after["periods"] - before["periods"]
    per_step = {part: 1e3 * (after[part] - before[part]) / steps if steps else float("nan")
                for part in PARTS if part != "period"}
    per_step["period"] = (1e3 * (after["period"] - before["period"]) / periods
                          if periods else float("nan"))
    per_step["outside_worker"] = per_step["period"] - (
        per_step["execute_model"] + per_step["sample_tokens"] + per_step["take_draft_token_ids"])
    per_step["steps"] = steps
    return per_step


BREAKDOWN_COLUMNS = (
    ("period", "step (wall)"), ("target_forward", "target forward"),
    ("target_attention", "target attention"),
    ("execute_model", "execute_model"), ("sample", "sample"),
    ("drafter_propose", "drafter"), ("control_plan", "control plan"),
    ("retrieval_plan", "retrieval plan"), ("tap", "tap"),
    ("take_draft_token_ids", "take drafts"), ("outside_worker", "outside worker"),
)
"""The table's columns: (part, heading)."""


def breakdown_table(rows: list[tuple[str, dict[str, float]]]) -> str:
    """Milliseconds per decode step, one line per (label, breakdown)."""
    lines = ["| run | " + " | ".join(heading for _, heading in BREAKDOWN_COLUMNS) + " |",
             "|---|" + "---:|" * len(BREAKDOWN_COLUMNS)]
    for label, parts in rows:
        lines.append(f"| {label} | " + " | ".join(
            f"{parts.get(part, float('nan')):.2f}" for part, _ in BREAKDOWN_COLUMNS) + " |")
    return "\n".join(lines)
