"""Patches of vLLM's engine construction: the options checked, vLLM's config
adjusted, the set-up resolved once and kept for the config; the model runner
an engine with ``spec_extend`` gets."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_specextend.common.engine_setup import (
    EngineSetup,
    adjust_engine_args,
    adjust_vllm_config,
    is_kept,
    keep_setup,
    kept_setup,
    requested_config,
    requests_spec_extend,
)
from vllm_specextend.common.options import SpecExtendConfigError, spec_extend_options
from vllm_specextend.log import plugin_logger
from vllm_specextend.patches.wrapping import wrap_once

logger = plugin_logger(__name__)


def engine_setup(engine: Any) -> EngineSetup | None:
    """An engine's set-up, as its construction kept it (None: SpecExtend is
    off, or the config was not built through ``EngineArgs``)."""
    config = engine.vllm_config
    return kept_setup(config) if is_kept(config) else None


def patch_create_engine_config(module: ModuleType) -> None:
    def make_wrapper(original: Callable) -> Callable:
        def create_engine_config(self, *args, **kwargs):
            # Options checked on their own, vLLM's config adjusted, then the
            # options resolved against it, once for the engine, and the
            # result kept for every reader of the config.
            config = requested_config(self.additional_config)
            user_chunk_budget = self.max_num_batched_tokens
            if config is not None:
                adjust_engine_args(self, config)
            vllm_config = original(self, *args, **kwargs)
            if config is not None:
                adjust_vllm_config(vllm_config, config, user_chunk_budget)
            keep_setup(vllm_config)
            return vllm_config

        return create_engine_config

    wrap_once(module.EngineArgs, "create_engine_config", make_wrapper)


def patch_version_guard(module: ModuleType, message: str) -> None:
    """On an unsupported vLLM: refuse ``spec_extend`` at engine construction."""

    def make_wrapper(original: Callable) -> Callable:
        def create_engine_config(self, *args, **kwargs):
            if spec_extend_options(self.additional_config) is not None:
                raise SpecExtendConfigError(message)
            return original(self, *args, **kwargs)

        return create_engine_config

    wrap_once(module.EngineArgs, "create_engine_config", make_wrapper)


def patch_use_v2_model_runner(module: ModuleType) -> None:
    def make_wrapper(stock: Callable) -> Callable:
        def use_v2_model_runner(self) -> bool:
            chosen = stock(self)
            # Once the engine is built, its kept set-up answers; while vLLM
            # builds the config (its __post_init__ reads this property), the
            # options already checked on their own do.
            requested = (kept_setup(self) is not None if is_kept(self)
                         else requests_spec_extend(self))
            if module.envs.VLLM_USE_V2_MODEL_RUNNER is not None or not requested:
                return chosen
            forced = (
                self.attention_config.hisparse_config is not None
                or getattr(self, "watermark_config", None) is not None
            )
            if chosen and forced:
                return chosen
            logger.info_once(
                "SpecExtend: retrieval runs in vLLM's V1 model runner; "
                "VLLM_USE_V2_MODEL_RUNNER=1 selects Model Runner V2 "
                "(its SpecExtend speculators have not run on a GPU yet)."
            )
            return False

        return use_v2_model_runner

    wrap_once(module.VllmConfig, "use_v2_model_runner", make_wrapper)
