"""How every patch is applied: :func:`wrap_once`, with a mark against
wrapping twice."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType

PATCHED_MARK = "_specextend_wrapped"


def wrap_once(owner: type | ModuleType, name: str,
              make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` with ``make_wrapper(original)``, once: a second
    call finds the mark and does nothing. A property is wrapped on its getter.
    The wrapper gets ``original``'s name, docs and ``__wrapped__``."""
    current = inspect.getattr_static(owner, name)
    is_property = isinstance(current, property)
    original = current.fget if is_property else getattr(owner, name)
    if getattr(original, PATCHED_MARK, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, PATCHED_MARK, True)
    setattr(owner, name, property(wrapper) if is_property else wrapper)
