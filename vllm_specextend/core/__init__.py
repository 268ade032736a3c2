"""The algorithm as pure torch: options, scoring, block selection and table
rewriting, re-positioning, counters and per-step planning (the host's per-row
work in numpy and numba-compiled loops).

Nothing in this package imports vLLM, so every piece runs on tensors alone
(tests, notebooks, ``benchmarks/gpu_kernels.py`` on a machine with torch,
triton and numba only).
"""
