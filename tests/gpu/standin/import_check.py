"""Before spending GPU time: import, on this CPU, the modules a CUDA engine
imports, from the staged tree (``.vgpu/``), with CUDA as vLLM's platform and
the stand-in ops registered. An op vLLM names at import that the stand-in
lacks fails here as it would there.

    bash tests/gpu/standin/stage.sh    # runs this at its end
"""

from __future__ import annotations

import importlib
import sys

MODULES = (
    "vllm._custom_ops", "vllm.compilation.backends", "vllm.compilation.cuda_graph",
    "vllm.compilation.piecewise_backend", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator", "vllm.v1.spec_decode.draft_model",
    "vllm.v1.spec_decode.eagle", "vllm.v1.attention.backends.triton_attn",
    "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.mimo", "vllm.model_executor.models.mimo_mtp",
    "vllm.model_executor.models.llama_eagle3", "vllm.v1.sample.sampler",
    "vllm.v1.sample.rejection_sampler", "vllm.model_executor.warmup.kernel_warmup",
    "vllm_specextend.patches", "vllm_specextend.drafters.v1_draft_model",
    "vllm_specextend.drafters.v1_eagle", "vllm_specextend.drafters.mrv2_draft_model",
    "vllm_specextend.drafters.mrv2_eagle", "vllm_specextend.drafters.mrv2_mtp",
)


def main() -> int:
    import vllm.triton_utils.importing as triton_importing

    if not triton_importing.HAS_TRITON:
        sys.exit("import_check needs vLLM's Triton path: run it with the staged tree's "
                 "triton_utils forced on (stage.sh does)")
    import vllm.platforms as platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class Hopper(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(9, 0)

    platforms._current_platform = Hopper()
    failed = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 (report every failure)
            failed.append(f"{name}: {error!r}")
    print(f"[import_check] {len(MODULES) - len(failed)} of {len(MODULES)} modules import "
          "with the stand-in ops")
    print("\n".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
