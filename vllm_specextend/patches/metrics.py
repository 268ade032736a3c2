"""Patches that pull retrieval's figures from the workers into Prometheus
(``vllm_specextend/metrics.py``) before vLLM logs or reads its own."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from vllm_specextend.patches.engine_construction import engine_setup
from vllm_specextend.patches.wrapping import wrap_once


def add_worker_metrics_method() -> None:
    """The worker's ``spec_extend_metrics``, for ``collective_rpc``: vLLM's
    executors call a worker method by name (``getattr(self.worker, method)``,
    vllm/v1/executor/multiproc_executor.py:1051; ``run_method``,
    vllm/v1/serial_utils.py:501), and the front end can only name one that
    every worker class has; a bytes-pickled function would need
    ``VLLM_ALLOW_INSECURE_SERIALIZATION``. Added once, beside vLLM's own."""
    from vllm.v1.worker.worker_base import WorkerBase

    from vllm_specextend.metrics import WORKER_METHOD, worker_metrics

    if not hasattr(WorkerBase, WORKER_METHOD):
        setattr(WorkerBase, WORKER_METHOD, worker_metrics)


def patch_llm_engine_get_metrics(module: ModuleType) -> None:
    def make_wrapper(original: Callable) -> Callable:
        def get_metrics(self):
            if engine_setup(self) is not None:
                from vllm_specextend.metrics import WORKER_METHOD, publish

                publish(self.vllm_config, self.collective_rpc(WORKER_METHOD))
            return original(self)

        return get_metrics

    wrap_once(module.LLMEngine, "get_metrics", make_wrapper)


def patch_async_llm_do_log_stats(module: ModuleType) -> None:
    def make_wrapper(original: Callable) -> Callable:
        async def do_log_stats(self):
            if engine_setup(self) is not None and not self.errored:
                from vllm_specextend.metrics import WORKER_METHOD, publish

                publish(self.vllm_config, await self.collective_rpc(WORKER_METHOD))
            await original(self)

        return do_log_stats

    wrap_once(module.AsyncLLM, "do_log_stats", make_wrapper)
