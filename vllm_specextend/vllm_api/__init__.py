"""Every vLLM name this package imports, subclasses, wraps, swaps or reads, and
a check that a vLLM source tree still has each one as the package expects.

The check reads the sources with :mod:`ast` (nothing is imported), so it runs
against the installed vLLM (``tests/test_vllm_api.py``) and against a release
that is not installed, e.g. a downloaded GPU wheel
(``scripts/check_vllm_api.py``). A class's members are looked up through its
bases inside the tree, as Python would.

- ``manifest.py``: the expectations, one list;
- ``sources.py``: :class:`VllmSources`, a source tree read with ``ast``;
- ``checker.py``: :func:`check` and the report.

Kinds of expectation:

- ``module``: the module exists;
- ``class`` / ``function``: defined (or imported) under that name in the module;
- ``method``: a function of the class (or of a base); ``params`` must appear
  in its signature in that order (positional parameters the package passes
  or receives by position), ``keywords`` anywhere in it;
- ``attribute``: readable on instances: a class-level field or assignment, a
  property, or ``self.<name> = ...`` in one of the class's methods;
- ``global``: a module-level name the package swaps, with ``used_in`` the
  function that must look it up at call time (so the swap takes effect).
"""

from __future__ import annotations

from vllm_specextend.vllm_api.checker import (
    absent_optional,
    check,
    format_report,
    source_version,
)
from vllm_specextend.vllm_api.manifest import (
    CONFIG,
    MANIFEST,
    MRV2_RUNNER,
    MRV2_SPEC,
    MRV2_STANDALONE,
    MRV2_TD,
    TAPPED_BACKENDS,
    V1_BASE,
    V1_RUNNER,
    Expect,
)
from vllm_specextend.vllm_api.sources import VllmSources

__all__ = [
    "CONFIG",
    "MANIFEST",
    "MRV2_RUNNER",
    "MRV2_SPEC",
    "MRV2_STANDALONE",
    "MRV2_TD",
    "TAPPED_BACKENDS",
    "V1_BASE",
    "V1_RUNNER",
    "Expect",
    "VllmSources",
    "absent_optional",
    "check",
    "format_report",
    "source_version",
]
