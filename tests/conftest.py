import os

# Under pytest-xdist (``scripts/run_tests.sh`` runs one worker per core),
# each worker keeps to one core: vLLM's CPU worker would otherwise bind its
# OpenMP threads to every core, and the spinning threads of one worker's
# engine slow the other's. Set before torch starts its thread pool.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _XDIST_WORKER is not None:
    _cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                          str(_cores[int(_XDIST_WORKER.removeprefix("gw")) % len(_cores)]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from tests.tiny_models import TARGET_LLAMA, build_model, build_noisy_copy

LONG_MARKERS = ("engine", "interpreter")


def pytest_sessionstart(session):
    """Compile the package's numba loops once, before any worker starts, into
    numba's cache beside the package: on a fresh clone every worker and every
    engine process they start (servers, tensor-parallel ranks) would
    otherwise compile them again, ~20 s each, at the same time."""
    if _XDIST_WORKER is None:
        from vllm_specextend.control.warm_up import warm_up_control
        from vllm_specextend.retrieval.row_kernels import warm_up_row_kernels

        warm_up_control()
        warm_up_row_kernels()


def pytest_collection_modifyitems(items):
    """The modules with a test that starts an engine or runs Triton's
    interpreter first (a stable sort by module, so a module's tests stay
    together and in order): under xdist a module runs in one worker, and a
    long one left for last would run while the other workers sit idle."""
    long_modules = {getattr(item, "module", None) for item in items
                    if any(item.get_closest_marker(m) for m in LONG_MARKERS)}
    items.sort(key=lambda item: getattr(item, "module", None) not in long_modules)


@pytest.fixture(scope="session")
def target_reference():
    """Greedy outputs of the target alone, memoised for the whole run (see
    ``engine_utils.TargetAloneReference``)."""
    from tests.engine_utils import TargetAloneReference

    reference = TargetAloneReference()
    yield reference
    reference.close()


@pytest.fixture(scope="session")
def target_model():
    return build_model(TARGET_LLAMA)


@pytest.fixture(scope="session")
def draft_model():
    """A draft that agrees with the target often (acceptance about 55%)."""
    return build_noisy_copy(TARGET_LLAMA, noise=0.03)
