"""Host syncs found by CUDA's sync debug mode, for the benchmarks that run
the package's per-step work on a GPU without vLLM (``gpu_kernels``,
``catch_up_syncs``)."""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SYNC_DEBUG_NOTICE = "Synchronization debug mode is a prototype feature"
"""torch's one-time notice on entering the mode: not a sync."""


class SyncSites:
    """Inside, ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising
    operation's warning is appended to ``found`` with its innermost frame in
    the package (the benchmark scripts' own frames skipped) and the stack.
    Records nothing without CUDA."""

    def __init__(self, found: list) -> None:
        self.found = found

    def __enter__(self) -> SyncSites:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        self._warnings.__exit__(*exc)

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if str(message).startswith(SYNC_DEBUG_NOTICE):
            return
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if str(REPO) in f.filename
                and str(REPO / "benchmarks") not in f.filename]
        where = (ours or stack)[-1]
        filename = where.filename
        if str(REPO) in filename:
            filename = str(Path(filename).relative_to(REPO))
        self.found.append({
            "message": str(message).splitlines()[0],
            "site": f"{filename}:{where.lineno}",
            "code": where.line,
            "stack": traceback.format_list(stack[-12:]),
        })
