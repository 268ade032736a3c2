"""Cross-model retrieval: which KV blocks the draft attends to.

- ``owner.py``: :class:`~vllm_specextend.retrieval.owner.DraftRetrieval`, the
  one object a drafter adapter holds for it, and the hooks on vLLM's
  attention layers (``layer_hooks.py``: the target tap). The only modules
  here that import vLLM; ``draft_kv_copy.py`` is the plain draft KV copy of
  compact positions.
- ``planner.py``: :class:`~vllm_specextend.retrieval.planner.RetrievalPlanner`,
  a step's plan (stage, score, retrieve, rewrite, record) from its parts:
  ``request_rows.py`` (per-slot state, row classification; compiled loops in
  ``row_kernels.py``), ``chunk_scoring.py`` (scores per slot),
  ``compact_layout.py`` (windowed layouts, private-layout swaps),
  ``repositioning.py`` (RoPE re-rotation of working caches),
  ``refresh.py`` (retrieval on acceptance drops), ``counters.py`` (metrics on
  the device), ``target_tap.py`` (the target's queries and keys),
  ``draft_view.py`` (what a plan answers).
- ``kernels/``: scoring and selection as tensor functions, torch and Triton.

Pure torch, numpy and numba but for the owner and its hooks, so the
algorithm runs on tensors alone (tests, notebooks, ``benchmarks/gpu_kernels.py``).
"""
