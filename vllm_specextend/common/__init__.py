"""What both features (retrieval, goodput control) and the drafter adapters
share, beneath them: the user's options (``options.py``) and what an engine
resolves them to, with every refusal (``engine_setup.py``,
``engine_checks.py``); a step's batch as the adapters describe it
(``planning_batch.py``); the request slots both features keep per-request
state by (``request_slots.py``); host lists staged to the device
(``staging.py``); the numba compilation of the host loops and the arrays
they take (``compiled.py``, ``kernel_args.py``); device-side histograms
(``histograms.py``).

Nothing here imports vLLM or either feature.
"""
