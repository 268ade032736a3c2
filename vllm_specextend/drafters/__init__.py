"""One adapter per drafter x model runner. Each subclasses vLLM's own drafter
class and the runner's retrieval mixin, and overrides only what hands the
runner's inputs to :class:`~vllm_specextend.retrieval.owner.DraftRetrieval`
and its view to the draft's attention metadata.

- ``v1_retrieval.py``: the V1 runner's mixin (``SpecDecodeBaseProposer``
  overrides); ``v1_draft_model.py``: ``draft_model`` drafts;
  ``v1_eagle.py``: EAGLE-1 / EAGLE-3 heads.
- ``mrv2_retrieval.py``: Model Runner V2's mixin (speculator overrides);
  ``mrv2_draft_model.py``: ``draft_model`` drafts;
  ``mrv2_target_dependent.py``: its extension for speculators that run over
  the target's metadata and CUDA graphs; ``mrv2_eagle.py``: EAGLE-1 / EAGLE-3
  heads; ``mrv2_mtp.py``: MTP layers.

In the V1 runner ``mtp`` runs in ``EagleProposer`` too (``v1_eagle.py``).
"""
