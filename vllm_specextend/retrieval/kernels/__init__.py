"""Retrieval's tensor computations, each in torch and, for CUDA, Triton:
chunk scoring from the target's last-layer attention (``scoring.py``,
``scoring_triton.py`` over the work list of ``scoring_work.py``), top-k
block selection and the block-table rewrite (``selection.py``,
``selection_triton.py``). The Triton kernels' bodies live in the
``_*_triton_kernels.py`` modules, compiled on first use. No vLLM."""
