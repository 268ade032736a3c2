"""One adapter per drafter x model runner. Each subclasses vLLM's own drafter
class and the runner's retrieval mixin, and overrides only what hands the
runner's inputs to :class:`~vllm_specextend.retrieval.owner.DraftRetrieval`
and its view to the draft's attention metadata.

- ``v1_retrieval.py``: the V1 runner's mixin (``SpecDecodeBaseProposer``
  overrides); ``v1_draft_model.py``: ``draft_model`` drafts;
  ``v1_eagle.py``: EAGLE-1 / EAGLE-3 heads.
- ``mrv2_retrieval.py``: Model Runner V2's mixin (speculator overrides);
  ``mrv2_draft_model.py``: ``draft_model`` drafts.
"""
