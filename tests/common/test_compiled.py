"""The package's compiled loops are cached under a stamp of every module
(``common/compiled.py``): numba checks a cached function against its own file
only, while a caller's cache entry carries its callees' machine code."""

import subprocess
import sys
from pathlib import Path

import vllm_specextend
from vllm_specextend.common.compiled import PackageStampedLocator, package_stamp
from vllm_specextend.control import plan_kernels


def test_every_module_is_in_the_stamp():
    package = Path(vllm_specextend.__file__).parent
    stamped = {path for path, _, _ in package_stamp()}
    assert stamped == {str(p.relative_to(package)) for p in package.rglob("*.py")}
    assert "control/choice_kernel.py" in stamped


def test_a_kernel_calling_another_modules_kernel_is_stamped_with_the_package():
    # plan_rows carries choice_kernel's choice: its own file's stamp would
    # keep an edited choice's old code running from the cache.
    locator = plan_kernels.plan_rows._cache._impl.locator
    assert isinstance(locator, PackageStampedLocator)
    own, package = locator.get_source_stamp()
    assert package == package_stamp()
    assert own == (Path(plan_kernels.__file__).stat().st_mtime,
                   Path(plan_kernels.__file__).stat().st_size)


STEPS_WITHOUT_COMPILING = """
import sys
from benchmarks.control_decisions import cases, scenario
from vllm_specextend.control.warm_up import warm_up_control

def signatures():
    return {f"{name}.{attr}": len(obj.signatures)
            for name, module in list(sys.modules.items()) if name.startswith("vllm_specextend")
            for attr, obj in vars(module).items()
            if hasattr(obj, "py_func") and hasattr(obj, "signatures")}

warm_up_control()  # as before a drafter's SpeculationControl is built
before = signatures()
# Simulated engines (benchmarks/control_decisions.py): batches 1 to 256, K
# 1 to 10, heads and draft models, FULL graphs, block tables or none,
# arrivals, departures, preemptions, catch-up budgets, probes, explorations.
for case in cases(12):
    scenario(**{**case, "steps": min(case["steps"], 200)})
after = signatures()
assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
"""


def test_steps_compile_nothing_after_construction():
    # Goodput control compiles every loop it calls before a drafter's control
    # is built (control/warm_up.py): a step that compiles stalls serving
    # (plan_rows once compiled for 1.8 s at the first step). A fresh process,
    # so that no other test has compiled them first.
    subprocess.run([sys.executable, "-c", STEPS_WITHOUT_COMPILING], check=True, timeout=600)


PLANNER_STEPS_WITHOUT_COMPILING = """
import numpy as np
import torch
from tests.retrieval.test_planner import BLOCK_SIZE, K, planning_batch
from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.retrieval import row_kernels
from vllm_specextend.retrieval.draft_view import PrivateLayouts
from vllm_specextend.retrieval.planner import RetrievalPlanner, decode_rows

def signatures():
    return {name: len(obj.signatures) for name, obj in vars(row_kernels).items()
            if hasattr(obj, "py_func") and hasattr(obj, "signatures")}

planners = []
for refresh, compact in (("interval", False), ("acceptance", False), ("interval", True)):
    config = SpecExtendConfig(mode="streaming", min_context_tokens=256, sink_tokens=16,
                              recent_tokens=64, chunk_size=32, top_k_chunks=2,
                              retrieval_interval=2, retrieval_refresh=refresh)
    planner = RetrievalPlanner(config, max_num_reqs=4, max_model_len=4096,
                               max_num_speculative_tokens=K, draft_window=512,
                               compact_positions=compact, device=torch.device("cpu"))
    planner.bind_kv_cache(tap=None, block_size=BLOCK_SIZE, private_layouts=(
        PrivateLayouts(first_block=4096, areas=2, blocks_per_area=32) if compact else None))
    planners.append(planner)
before = signatures()
# Warmed up at construction (advance_retrieval_rows runs inside classify_step).
assert all(before[name] for name in ("classify_rows", "classify_step", "note_retrievals",
                                     "reset_slots")), before
for planner in planners:
    # Decodes past the window, a short one, prompt chunks (windowed with
    # compact positions), accepted and rejected drafts, a departure.
    for step in range(6):
        ids = ["a", "b", "c"] if step < 4 else ["a", "d"]
        query = [K + 1, 1 + step % 2, 64] if step < 4 else [K + 1, 256]
        context = [2000 + 3 * step, 100 + step, 64 * step] if step < 4 else [2020, 0]
        prompt = [1000, 50, 1024] if step < 4 else [1000, 3000]
        planner.plan(planning_batch(ids, query, context, prompt))
decode_rows(np.array([K + 1]), np.array([10]), np.array([5]), K)
after = signatures()
assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
"""


def test_planning_steps_compile_no_row_kernel_after_construction():
    # The planner's row loops compile (or load) at its construction, on
    # records built by the constructors it plans with (row_kernels.py).
    subprocess.run([sys.executable, "-c", PLANNER_STEPS_WITHOUT_COMPILING], check=True,
                   timeout=600, cwd=Path(__file__).parents[2])
