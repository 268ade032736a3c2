"""One adapter per drafter x model runner. Each subclasses vLLM's own drafter
class and the runner's mixin of overrides, and holds the two features side
by side (``features.py``): an optional
:class:`~vllm_specextend.retrieval.owner.DraftRetrieval` and an optional
:class:`~vllm_specextend.control.speculation_control.SpeculationControl`. The overrides only
hand the runner's inputs to each feature and the retrieval's view to the
draft's attention metadata; they are the only code that writes the runner's
state (the request slots both features share, the first pass's inputs).

Naming: an adapter is ``SpecExtend`` + the vLLM class it subclasses
(``SpecExtendDraftModelProposer`` subclasses ``DraftModelProposer``); a
runner's mixin is ``<runner>Overrides``.

- ``v1_overrides.py``: the V1 runner's mixin (``SpecDecodeBaseProposer``
  overrides), with ``v1_catch_up.py`` (goodput control's catch-up in the
  first pass's inputs); ``v1_draft_model.py``: ``draft_model`` drafts;
  ``v1_eagle.py``: EAGLE-1 / EAGLE-3 heads (and ``mtp``, which the V1
  runner also runs in ``EagleProposer``).
- ``mrv2_overrides.py``: Model Runner V2's mixin (speculator overrides);
  ``mrv2_draft_model.py``: ``draft_model`` drafts;
  ``mrv2_target_dependent.py``: its extension for speculators that run over
  the target's metadata and CUDA graphs; ``mrv2_eagle.py``: EAGLE-1 / EAGLE-3
  heads; ``mrv2_mtp.py``: MTP layers.

Layout: files prefixed by runner, not a folder per speculator as MRV2's
``v1/worker/gpu/spec_decode/<speculator>/`` has. What the adapters share is
per runner (each runner's mixin is most of the code; an adapter is 15-25
lines naming two base classes), so the prefix keeps each runner's mixin
next to its adapters; a folder per speculator would hold one such file each
and split the runner's code from what uses it. MRV2's folders each hold a
speculator with its own kernels and metadata builders, which ours reuse.
"""
