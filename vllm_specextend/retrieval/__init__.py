"""Retrieval's owner inside a vLLM worker: the options resolved for an engine
(``engine_options``), the hooks on vLLM's attention layers (``layer_hooks``,
``draft_kv_copy``), and :class:`~vllm_specextend.retrieval.owner.DraftRetrieval`,
the one object every drafter adapter holds."""
