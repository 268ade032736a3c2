"""Patches of vLLM's model runners: our drafter built in place of vLLM's
(V1 runner, Model Runner V2), every row drafting, and each request's drafts
cut to its goodput plan."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_specextend.common.engine_setup import SETUP_ATTRIBUTE, EngineSetup, keep_setup
from vllm_specextend.patches.cpu_sampler import patch_cpu_rejection_sampler
from vllm_specextend.patches.metrics import add_worker_metrics_method
from vllm_specextend.patches.wrapping import wrap_once


def patch_model_runner_init(module: ModuleType) -> None:
    def draft_model_proposer(stock: type, setup: EngineSetup) -> type:
        from vllm_specextend.drafters.v1_draft_model import SpecExtendDraftModelProposer

        patch_cpu_rejection_sampler()
        return SpecExtendDraftModelProposer

    def eagle_proposer(stock: type, setup: EngineSetup) -> type:
        from vllm_specextend.drafters.v1_eagle import SpecExtendEagleProposer

        patch_cpu_rejection_sampler()
        return SpecExtendEagleProposer

    def every_row_drafts(runner: Any) -> None:
        # vLLM switches drafting off for the whole batch when its longest
        # request does not fit the draft's window
        # (vllm/v1/worker/gpu_model_runner.py:4382, in sample_tokens, asks
        # self._input_fits_in_drafter, defined at :4288, with no option to
        # turn it off); our proposer drafts every row inside the window
        # (compact positions), so every row drafts. Set on this runner only
        # (the class stays stock for other engines).
        runner._input_fits_in_drafter = _every_row_drafts

    _swap_while_runner_is_built(
        module,
        {"DraftModelProposer": draft_model_proposer, "EagleProposer": eagle_proposer},
        every_row_drafts,
    )
    wrap_once(module.GPUModelRunner, "_get_draft_token_ids_cpu", _keep_planned_drafts)


def _every_row_drafts(common_attn_metadata: Any) -> bool:
    return common_attn_metadata is not None


def _keep_planned_drafts(stock: Callable) -> Callable:
    """With goodput control, each request keeps the drafts its plan gives it
    (the drafter ran for the longest); the scheduler then verifies only those."""

    def _get_draft_token_ids_cpu(self):
        draft_token_ids, req_ids = stock(self)
        # Our adapters (drafters/features.py) answer; a stock drafter has none.
        planned = getattr(getattr(self, "drafter", None), "planned_draft_lengths", None)
        lengths = None if planned is None else planned()
        if lengths is None:
            return draft_token_ids, req_ids
        kept = lengths.rows(req_ids)
        return [ids if length is None else ids[:length]
                for ids, length in zip(draft_token_ids, kept)], req_ids

    return _get_draft_token_ids_cpu


def patch_model_runner_v2_init(module: ModuleType) -> None:
    def speculator_factory(stock: Callable, setup: EngineSetup) -> Callable:
        if setup.method == "draft_model":
            from vllm_specextend.drafters.mrv2_draft_model import (
                SpecExtendStandaloneARSpeculator as speculator,
            )
        elif setup.method == "mtp":
            from vllm_specextend.drafters.mrv2_mtp import SpecExtendMTPSpeculator as speculator
        else:
            from vllm_specextend.drafters.mrv2_eagle import (
                SpecExtendEagleSpeculator as speculator,
            )

        def init_speculator(vllm_config, device, req_states):
            return speculator(vllm_config, device, setup=setup)

        return init_speculator

    _swap_while_runner_is_built(module, {"init_speculator": speculator_factory})


def _swap_while_runner_is_built(
    module: ModuleType,
    replacements: dict[str, Callable[[Any, EngineSetup], Any]],
    after_init: Callable[[Any], None] | None = None,
) -> None:
    """While a ``module.GPUModelRunner`` with ``spec_extend`` is built, each
    module global ``name`` is ``replacements[name](stock, setup)``; they are
    restored right after, so the stock objects are untouched and
    ``isinstance`` checks keep working. The runner keeps the setup in
    ``SETUP_ATTRIBUTE`` for the drafter it builds.

    Why a swap: vLLM builds the drafter inline in ``GPUModelRunner.__init__``
    by module-level name, with no factory to override:
    ``vllm/v1/worker/gpu_model_runner.py:612`` (``DraftModelProposer(...)``),
    ``:644`` (``EagleProposer(...)``) and ``vllm/v1/worker/gpu/model_runner.py:296``
    (``init_speculator(...)``). Replacing ``runner.drafter`` after ``__init__``
    would build the stock drafter first (its buffers allocated twice) and miss
    what ``__init__`` reads from it (``eagle3_use_aux_hidden_state``)."""

    def make_wrapper(original: Callable) -> Callable:
        def __init__(self, vllm_config, *args, **kwargs):
            # Kept at engine construction when the runner shares the engine's
            # process; a worker process resolves its pickled copy here, once.
            setup = keep_setup(vllm_config)
            if setup is None:
                return original(self, vllm_config, *args, **kwargs)
            add_worker_metrics_method()
            setattr(self, SETUP_ATTRIBUTE, setup)
            stock = {name: getattr(module, name) for name in replacements}
            for name, replacement in replacements.items():
                setattr(module, name, replacement(stock[name], setup))
            try:
                original(self, vllm_config, *args, **kwargs)
            finally:
                for name, value in stock.items():
                    setattr(module, name, value)
            if after_init is not None:
                after_init(self)

        return __init__

    wrap_once(module.GPUModelRunner, "__init__", make_wrapper)
