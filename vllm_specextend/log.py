"""The package's logger: vLLM's, so its configuration applies to our messages."""

from __future__ import annotations

import logging


def plugin_logger(module_name: str) -> logging.Logger:
    """A logger under vLLM's ``vllm`` namespace, so vLLM's logging
    configuration (handlers, level, format) applies to our messages too.
    Without vLLM (retrieval's planner and kernels on a machine that has only torch) a
    standard logger of the same name."""
    try:
        from vllm.logger import init_logger
    except ImportError:
        return logging.getLogger(f"vllm.plugins.{module_name}")
    return init_logger(f"vllm.plugins.{module_name}")
