"""How the package's per-row host loops are compiled: numba, cached on disk
(:data:`compiled`), the way vLLM's n-gram proposer compiles its batch loop.

numba checks a cached function against its own source file only, yet a
compiled function that calls another module's compiled function carries
that callee's machine code in its cache entry. After an edit to the callee
(a ``git pull`` into an editable install) the caller would keep running the
old callee from the cache. So every cache entry of this package is stamped
with all of the package's modules (:func:`package_stamp`): any change
recompiles the package's loops once (seconds), and a fresh install starts
from empty caches anyway.
"""

from __future__ import annotations

import functools
from pathlib import Path

from numba import __version__ as numba_version
from numba import njit
from numba.core import caching

from vllm_specextend.log import plugin_logger

_PACKAGE = Path(__file__).resolve().parent.parent
_CacheLocator = caching._CacheLocator
_CacheImpl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
"""numba's cache machinery (``_CacheImpl`` in older releases)."""


@functools.cache
def package_stamp() -> tuple[tuple[str, float, int], ...]:
    """Each module of the package: its path, modification time and size."""
    stamps = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        stat = path.stat()
        stamps.append((str(path.relative_to(_PACKAGE)), stat.st_mtime, stat.st_size))
    return tuple(stamps)


class PackageStampedLocator(_CacheLocator):
    """For a function of this package, the cache location numba would pick,
    with :func:`package_stamp` added to the stamp of the function's file."""

    def __init__(self, inner: _CacheLocator) -> None:
        self._inner = inner

    def ensure_cache_path(self) -> None:
        self._inner.ensure_cache_path()

    def get_cache_path(self) -> str:
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return self._inner.get_source_stamp(), package_stamp()

    def get_disambiguator(self) -> str:
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file: str):
        if not Path(py_file).resolve().is_relative_to(_PACKAGE):
            return None
        for locator in _CacheImpl._locator_classes:
            if locator is not cls:
                inner = locator.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner)
        return None


if not isinstance(getattr(_CacheImpl, "_locator_classes", None), list):
    plugin_logger(__name__).warning(
        "numba %s has no cache locator list: compiled loops are cached per file, and an edit "
        "to one that another calls needs the package's __pycache__ cleared", numba_version)
elif PackageStampedLocator not in _CacheImpl._locator_classes:
    _CacheImpl._locator_classes.insert(0, PackageStampedLocator)

compiled = njit(cache=True)
"""Decorator of the package's compiled loops (``njit(cache=True)``, cached
under :class:`PackageStampedLocator`)."""
