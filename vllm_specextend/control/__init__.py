"""Goodput control inside a vLLM worker, a feature beside retrieval: per step
and per request, how many drafts pay for their time, whether the draft's
forward runs at all, and what a skipped forward leaves to catch up.

- ``speculation_control.py``:
  :class:`~vllm_specextend.control.speculation_control.SpeculationControl`,
  the one object a drafter adapter holds for it (next to its
  ``DraftRetrieval``): plan, catch up, metrics;
- ``catch_up.py``: where the tokens a draft catches up go in its first pass
  (pure numpy / torch);
- ``paused_hidden_states.py``: an EAGLE head's kept target hidden states;
- ``goodput.py``: every decision of when a request pauses and whether the
  draft's forward runs (the choice on acceptance estimates, probes, warm-up,
  exploration, prompts; numpy, with the per-row loops compiled by numba:
  ``choice_kernel.py``, ``plan_kernels.py``), its tuning in
  ``parameters.py``; what it learns from in ``cost_model.py`` and
  ``acceptance.py``;
- ``frontiers.py``: each request's draft-KV frontier (what a resumed request
  must catch up; its per-row work compiled by numba: ``frontier_kernels.py``);
- ``kernel_state.py``: the records the compiled loops take; ``warm_up.py``:
  compiles them before a drafter's control is built, by a scripted engine.
"""
