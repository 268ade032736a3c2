"""Goodput control inside a vLLM worker, a feature beside retrieval: per step
and per request, how many drafts pay for their time, whether the draft's
forward runs at all, and what a skipped forward leaves to catch up.

- ``owner.py``: :class:`~vllm_specextend.control.owner.DraftControl`, the one
  object a drafter adapter holds for it (next to its ``DraftRetrieval``);
- ``catch_up.py``: where the tokens a draft catches up go in its first pass
  (pure numpy / torch);
- ``paused_hidden_states.py``: an EAGLE head's kept target hidden states;
- ``goodput.py``: the controller (step-cost model, acceptance estimates, the
  choice of each request's number of drafts, probing; numpy, with the per-row
  loops compiled by numba: ``choice_kernel.py``, ``plan_kernels.py``);
- ``speculation_control.py``: the engine's controller with each request's
  draft-KV frontier (what a resumed request must catch up; its per-row work
  compiled by numba: ``frontier_kernels.py``);
- ``kernel_state.py``: the records the compiled loops take; ``warm_up.py``:
  compiles them when ``DraftControl`` is built, by a scripted engine.
"""
