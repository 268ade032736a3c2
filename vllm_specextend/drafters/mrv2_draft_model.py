"""``draft_model`` drafts in Model Runner V2, with the draft attending only to
target-chosen context: vLLM's ``StandaloneARSpeculator`` (what MRV2's
``init_speculator`` returns for ``draft_model``) with the MRV2 retrieval
overrides (``mrv2_overrides.py``)."""

from __future__ import annotations

import torch
from typing_extensions import override

from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import (
    StandaloneARSpeculator,
)

from vllm_specextend.drafters.mrv2_overrides import MRV2Overrides


class SpecExtendStandaloneARSpeculator(MRV2Overrides, StandaloneARSpeculator):
    """What MRV2 builds instead of ``StandaloneARSpeculator`` when an engine
    has ``spec_extend`` options."""

    @override
    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, *args, **kwargs):
        positions = self._draft_positions(positions, positions.shape[0])
        return super()._run_model(input_ids, positions, *args, **kwargs)
