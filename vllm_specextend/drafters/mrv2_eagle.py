"""EAGLE heads (``eagle``, ``eagle3``) in Model Runner V2, with the head
attending only to target-chosen context: vLLM's ``EagleSpeculator`` with the
MRV2 target-dependent retrieval overrides (``mrv2_target_dependent.py``)."""

from __future__ import annotations

from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

from vllm_specextend.drafters.mrv2_target_dependent import MRV2TargetDependentOverrides


class SpecExtendEagleSpeculator(MRV2TargetDependentOverrides, EagleSpeculator):
    """What MRV2 builds instead of ``EagleSpeculator`` when an engine has
    ``spec_extend`` options."""
