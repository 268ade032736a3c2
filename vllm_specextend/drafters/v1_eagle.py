"""EAGLE heads (``eagle``, ``eagle3``) in vLLM's V1 model runner, with the
head attending only to target-chosen context: vLLM's ``EagleProposer`` with
the V1 retrieval overrides (``v1_overrides.py``).

A head's first pass takes the target's hidden states and runs at the
target's positions over the target's attention metadata; its attention
layer sits in the target's KV cache group, on the target's block table. So
the overrides that serve a draft model serve a head unchanged: every
metadata build of the head (first pass and each later step) gets the
compacted block table, and with compact positions the head runs inside its
window. Its hidden-state inputs from the target are untouched.
"""

from __future__ import annotations

from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_specextend.drafters.v1_overrides import V1Overrides


class SpecExtendEagleProposer(V1Overrides, EagleProposer):
    """What the V1 runner builds instead of ``EagleProposer`` when an engine
    has ``spec_extend`` options."""
