"""``draft_model`` drafts in vLLM's V1 model runner, with the draft attending
only to target-chosen context: vLLM's ``DraftModelProposer`` with the V1
retrieval overrides (``v1_overrides.py``)."""

from __future__ import annotations

from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_specextend.drafters.v1_overrides import V1Overrides


class SpecExtendDraftModelProposer(V1Overrides, DraftModelProposer):
    """What the V1 runner builds instead of ``DraftModelProposer`` when an
    engine has ``spec_extend`` options."""
