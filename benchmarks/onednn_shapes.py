"""What a forward of the real models' linear layers costs the first time it
runs at a row count, on this CPU: vLLM's CPU linear layers (``onednn_mm``,
one handler per weight, each keeping an LRU of 32 oneDNN primitives keyed by
the row count) create a primitive at a count they have not run lately.
Goodput control's probes and catch-ups run the draft (and the target's
verification) at counts a steady decode does not, so this is a cost a
probe can pay beyond its predicted price (``control/forced_account.py``).

    python -m benchmarks.onednn_shapes [--dtype float32 bfloat16] [--out DIR]

One handler per layer and weight, as vLLM builds them (random weights of the
Qwen2.5-Coder shapes); per row count, the layers' four projections run once
(first) and again (repeat). About a minute and 5 GiB.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.machine import fast_dtype, machine_info
from benchmarks.report import (
    LOCAL_RESULTS_DIR,
    config_color,
    git_commit,
    pyplot,
    record_run,
    save_figure,
)

ROW_COUNTS = (5, 9, 13, 17, 24, 33, 48, 65, 96, 129)
"""New row counts, after a warm-up at 4 (a paused decode step of batch 4)."""


@dataclass(frozen=True)
class LinearShapes:
    name: str
    config: str
    """The colour of the figure (``report.config_color``)."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    def projections(self) -> list[tuple[int, int]]:
        """(in, out) of a layer's qkv, o, gate_up and down projections."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return [(self.hidden, qkv), (self.heads * self.head_dim, self.hidden),
                (self.hidden, 2 * self.intermediate), (self.intermediate, self.hidden)]


MODELS = (LinearShapes("qwen2.5-coder-1.5b", "target", 28, 1536, 8960, 12, 2, 128),
          LinearShapes("qwen2.5-coder-0.5b", "draft_model", 24, 896, 4864, 14, 2, 64))


@dataclass
class ShapeCost:
    model: str
    dtype: str
    rows: int
    first_ms: float
    repeat_ms: float

    @property
    def extra_ms(self) -> float:
        return self.first_ms - self.repeat_ms


def _forward_ms(handlers, inputs, ops) -> float:
    start = time.perf_counter()
    for handler, x in zip(handlers, inputs):
        ops.onednn_mm(handler, x, None)
    return (time.perf_counter() - start) * 1e3


def measure(model: LinearShapes, dtype: str) -> list[ShapeCost]:
    import torch
    from vllm import _custom_ops as ops

    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    shapes = model.projections() * model.layers
    handlers = [ops.create_onednn_mm(torch.randn(n_out, n_in, dtype=torch_dtype).t(), 32)
                for n_in, n_out in shapes]
    costs = []
    for rows in (4, *ROW_COUNTS):
        inputs = [torch.randn(rows, n_in, dtype=torch_dtype) for n_in, _ in shapes]
        first = _forward_ms(handlers, inputs, ops)
        repeat = min(_forward_ms(handlers, inputs, ops) for _ in range(3))
        if rows != 4:
            costs.append(ShapeCost(model.name, dtype, rows, first, repeat))
    return costs


def write(costs: list[ShapeCost], out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(
        {"machine": machine_info(),
         "costs": [asdict(c) | {"extra_ms": c.extra_ms} for c in costs]}, indent=2))
    lines = ["| model | dtype | rows | first forward ms | repeat ms | extra ms |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {c.model} | {c.dtype} | {c.rows} | {c.first_ms:.1f} | {c.repeat_ms:.1f} | "
              f"{c.extra_ms:.1f} |" for c in costs]
    table = "\n".join(lines)
    (out_dir / "results.md").write_text(
        "# The linear layers' forward at a new row count (oneDNN primitive creation)\n\n"
        f"{table}\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for model in MODELS:
        for dtype, style in (("bfloat16", "-"), ("float32", "--")):
            rows = [c for c in costs if c.model == model.name and c.dtype == dtype]
            if rows:
                ax.plot([c.rows for c in rows], [c.extra_ms for c in rows], marker="o",
                        linestyle=style, color=config_color(model.config),
                        label=f"{model.name} {dtype}")
    ax.set_xlabel("rows (tokens in the forward)")
    ax.set_ylabel("first forward - repeat (ms)")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out_dir / "results.png", "Linear layers at a new row count")
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.onednn_shapes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=None,
                        help="default: float32 and, where it is fast here, bfloat16")
    parser.add_argument("--out", type=Path, default=LOCAL_RESULTS_DIR / "onednn-shapes")
    args = parser.parse_args(argv)
    dtypes = args.dtype or sorted({"float32", fast_dtype()})
    started, commit = time.time(), git_commit()
    costs = [c for model in MODELS for dtype in dtypes for c in measure(model, dtype)]
    table = write(costs, args.out)
    command = shlex.join(["python", "-m", "benchmarks.onednn_shapes",
                          *(sys.argv[1:] if argv is None else argv)])
    record_run(args.out, mode="onednn-shapes", description=__doc__.split("\n\n")[0],
               command=command, title=", ".join(m.name for m in MODELS), machine=machine_info(),
               dtype=" and ".join(dtypes), started=started, commit=commit)
    print(table)


if __name__ == "__main__":
    main()
