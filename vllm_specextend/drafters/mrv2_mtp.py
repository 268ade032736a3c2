"""MTP layers (``mtp``, one module) in Model Runner V2, attending only to
target-chosen context: vLLM's ``MTPSpeculator`` with the MRV2 target-dependent
retrieval overrides (``mrv2_target_dependent.py``)."""

from __future__ import annotations

from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator

from vllm_specextend.drafters.mrv2_target_dependent import MRV2TargetDependentOverrides


class SpecExtendMTPSpeculator(MRV2TargetDependentOverrides, MTPSpeculator):
    """What MRV2 builds instead of ``MTPSpeculator`` when an engine has
    ``spec_extend`` options."""
