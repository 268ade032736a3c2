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

warm_up_control()  # as DraftControl, the engine's, is built
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
    # Goodput control compiles every loop it calls when an engine's is built
    # (control/warm_up.py, from DraftControl): a step that compiles stalls serving (plan_rows
    # once compiled for 1.8 s at the first step). A fresh process, so that
    # no other test has compiled them first.
    subprocess.run([sys.executable, "-c", STEPS_WITHOUT_COMPILING], check=True, timeout=600)
