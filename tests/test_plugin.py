"""Plugin discovery, the vLLM version pin, and the post-import hook."""

import subprocess
import sys
import types

import pytest

import vllm_specextend
from vllm_specextend import UnsupportedVllmVersionError, check_vllm_version
from vllm_specextend.post_import import when_imported


def test_entry_point_is_discovered_by_vllms_plugin_loader():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins["spec_extend"] is vllm_specextend.register


def test_register_is_idempotent_and_wraps_each_seam_once():
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (
        TargetDependentARSpeculator,
    )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    vllm_specextend.register()
    vllm_specextend.register()
    assert EngineArgs.create_engine_config._specextend_wrapped
    assert VllmConfig.use_v2_model_runner.fget._specextend_wrapped
    assert GPUModelRunner.__init__._specextend_wrapped
    assert GPUModelRunnerV2.__init__._specextend_wrapped
    assert GPUModelRunner.initialize_kv_cache._specextend_wrapped
    assert GPUModelRunnerV2.initialize_kv_cache._specextend_wrapped
    assert TargetDependentARSpeculator.init_cudagraph_manager._specextend_wrapped
    assert Worker.determine_available_memory._specextend_wrapped
    assert CPUWorker.determine_available_memory._specextend_wrapped
    assert not getattr(CPUWorker.determine_available_memory.__wrapped__, "_specextend_wrapped", False)
    # Wrapped once: the wrapped function is the stock one.
    assert not getattr(EngineArgs.create_engine_config.__wrapped__, "_specextend_wrapped", False)


def test_installed_vllm_is_supported():
    check_vllm_version()


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.33.0", "0.33.1rc1"])
def test_both_supported_series_pass_the_version_check(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_version_check_names_installed_and_supported(version):
    with pytest.raises(UnsupportedVllmVersionError) as error:
        check_vllm_version(version)
    assert f"vLLM {version} is installed" in str(error.value)
    assert "supports vLLM 0.32.x and 0.33.x" in str(error.value)
    assert "VLLM_SPECEXTEND_SKIP_VERSION_CHECK=1" in str(error.value)


def test_mismatched_vllm_refuses_spec_extend_but_not_stock(target_model, draft_model):
    script = f"""
import vllm
vllm.__version__ = "0.31.0"
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
kw = dict(model={str(target_model)!r}, block_size=32, max_model_len=1024, dtype="float32",
          speculative_config={{"method": "draft_model", "model": {str(draft_model)!r},
                              "num_speculative_tokens": 3}})
EngineArgs(**kw).create_engine_config()
assert not hasattr(GPUModelRunner.__init__, "_specextend_wrapped")
try:
    EngineArgs(**kw, additional_config={{"spec_extend": {{}}}}).create_engine_config()
except ValueError as error:
    print("REFUSED:", error)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED: vllm-specextend" in result.stdout
    assert "vLLM 0.31.0 is installed" in result.stdout


def test_when_imported_runs_after_import_and_for_loaded_modules(tmp_path, monkeypatch):
    (tmp_path / "specextend_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("specextend_probe_mod", lambda m: seen.append(m.VALUE))
    assert seen == []
    import specextend_probe_mod  # noqa: F401

    assert seen == [1]
    when_imported("specextend_probe_mod", lambda m: seen.append(2))
    assert seen == [1, 2]
    assert isinstance(sys.modules["specextend_probe_mod"], types.ModuleType)


def test_an_engine_resolves_its_options_once(target_model, draft_model, monkeypatch):
    import pickle

    from tests.common.test_engine_setup import engine_config
    from vllm_specextend.common import engine_setup
    from vllm_specextend.patches import engine_construction

    calls = []
    resolve = engine_setup.resolve_setup
    monkeypatch.setattr(engine_setup, "resolve_setup", lambda config: calls.append(config)
                        or resolve(config))
    # Resolved at engine construction, kept for the config for every reader.
    ours = engine_config(target_model, draft_model, spec_extend={"top_k_chunks": 3})
    assert len(calls) == 1
    engine = types.SimpleNamespace(vllm_config=ours)
    setup = engine_construction.engine_setup(engine)
    assert engine_construction.engine_setup(engine) is setup and len(calls) == 1
    assert setup.config.top_k_chunks == 3 and setup.num_speculative_tokens == 3
    assert setup.steps_in_flight == ours.max_concurrent_batches
    # An engine core's or a worker's copy (pickled): its construction step
    # resolves it once, to the same set-up; its readers only read.
    copy = pickle.loads(pickle.dumps(ours))
    assert not engine_setup.is_kept(copy)
    assert engine_setup.keep_setup(copy) == setup and len(calls) == 2
    assert engine_setup.keep_setup(copy) == engine_setup.kept_setup(copy) == setup
    assert len(calls) == 2
    stock = types.SimpleNamespace(vllm_config=engine_config(target_model, draft_model))
    assert engine_construction.engine_setup(stock) is None
    assert engine_construction.engine_setup(stock) is None
    assert len(calls) == 3
    # A config vLLM built without EngineArgs: no reader resolves it.
    built_by_hand = types.SimpleNamespace(vllm_config=object())
    assert engine_construction.engine_setup(built_by_hand) is None
    assert len(calls) == 3


def test_wrap_once_wraps_methods_and_properties_once():
    from vllm_specextend.patches import wrap_once

    class Stock:
        def method(self):
            return 1

        @property
        def value(self):
            return 10

    def add_one(original):
        def wrapper(self):
            return original(self) + 1

        return wrapper

    for _ in range(2):
        wrap_once(Stock, "method", add_one)
        wrap_once(Stock, "value", add_one)
    assert Stock().method() == 2 and Stock().value == 11
    assert Stock.method.__wrapped__(Stock()) == 1


def test_vllms_kernel_overrides_register_beside_our_compiled_loops():
    """numba (our compiled host loops) loads llvmlite, whose FFI module
    answers every attribute; vLLM's ``register_kernels`` reads one of every
    module attribute, and the CPU platform calls it at every worker's start.
    Without the plugin's patch (``patches/cpu_sampler.py``, ``patch_kernel_dispatcher``) this
    fails with "'_lib_fn_wrapper' object has no attribute 'get'"."""
    import llvmlite.binding.ffi  # noqa: F401 (as numba loads it)

    from vllm.triton_utils import dispatcher

    import vllm_specextend.retrieval.row_kernels  # noqa: F401

    vllm_specextend.register()
    assert dispatcher.register_kernels._specextend_wrapped
    dispatcher.register_kernels({})  # scans every module, registers nothing
    assert "llvmlite.binding.ffi" in sys.modules
    with pytest.raises(AttributeError, match="_lib_fn_wrapper"):
        dispatcher.register_kernels.__wrapped__({})  # vLLM's own, unpatched
