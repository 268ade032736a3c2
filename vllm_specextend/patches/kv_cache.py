"""Patches of how vLLM sizes the KV cache: the engine core keeps the blocks
of private draft layouts out of the scheduler's pool; the workers count
retrieval's copies against the KV cache budget."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from vllm_specextend.common.engine_setup import keep_setup, private_layout_blocks
from vllm_specextend.log import plugin_logger
from vllm_specextend.patches.wrapping import wrap_once

logger = plugin_logger(__name__)


def patch_engine_core_kv_caches(module: ModuleType) -> None:
    def make_wrapper(original: Callable) -> Callable:
        def _initialize_kv_caches(self, vllm_config):
            scheduler_kv_cache_config = original(self, vllm_config)
            # Called from EngineCore.__init__: kept at engine construction
            # when the core shares the front end's process; an engine-core
            # process resolves its pickled copy here, once.
            setup = keep_setup(vllm_config)
            if setup is None or not setup.private_layouts:
                return scheduler_kv_cache_config
            block_size = scheduler_kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
            areas, per_area = private_layout_blocks(
                setup, scheduler_kv_cache_config.num_blocks, block_size,
                vllm_config.model_config.max_model_len)
            scheduler_kv_cache_config.num_blocks -= areas * per_area
            vllm_config.cache_config.num_gpu_blocks = scheduler_kv_cache_config.num_blocks
            logger.info(
                "SpecExtend: %d of the KV cache's blocks (%d tokens) kept for private "
                "draft layouts of %d requests", areas * per_area,
                areas * per_area * block_size, areas)
            return scheduler_kv_cache_config

        return _initialize_kv_caches

    wrap_once(module.EngineCore, "_initialize_kv_caches", make_wrapper)


def patch_worker_memory(module: ModuleType, class_name: str) -> None:
    def make_wrapper(original: Callable) -> Callable:
        def determine_available_memory(self):
            available = original(self)
            runner = self.model_runner
            drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
            retrieval = getattr(drafter, "retrieval", None)
            if retrieval is None:
                return available
            extra = retrieval.bytes_per_kv_token_outside_cache()
            cache = sum(
                spec.page_size_bytes / spec.block_size
                for spec in runner.get_kv_cache_spec().values()
            )
            share = extra / (cache + extra)
            logger.info(
                "SpecExtend: %.1f%% of the %.2f GiB KV cache budget goes to retrieval's "
                "copies (%d bytes per KV slot: the tap's keys%s)", 100 * share,
                available / 2**30, extra,
                ", the plain draft KV copy" if retrieval.compact_positions else "",
            )
            return int(available * (1 - share))

        return determine_available_memory

    wrap_once(getattr(module, class_name), "determine_available_memory", make_wrapper)
