"""Run a function on a module right after Python imports it.

``when_imported`` lets the plugin patch vLLM lazily: a front-end process that
never imports the model runner never pays for (or patches) it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def when_imported(module_name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` now if the module is imported, else right after."""
    module = sys.modules.get(module_name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        if not getattr(module.__spec__, "_initializing", False):
            hook(module)
            return
    _finder().add(module_name, hook)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable[[ModuleType], None]]] = {}

    def add(self, module_name: str, hook: Callable[[ModuleType], None]) -> None:
        hooks = self.hooks.setdefault(module_name, [])
        if hook not in hooks:
            hooks.append(hook)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.hooks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, self.hooks.pop(fullname))
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hooks: list[Callable[[ModuleType], None]]) -> None:
        self._loader = loader
        self._hooks = hooks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for hook in self._hooks:
            hook(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _finder() -> _PostImportFinder:
    for finder in sys.meta_path:
        if isinstance(finder, _PostImportFinder):
            return finder
    finder = _PostImportFinder()
    sys.meta_path.insert(0, finder)
    return finder
