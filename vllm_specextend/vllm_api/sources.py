"""A vLLM source tree read with :mod:`ast`, nothing imported: its modules,
classes (with their bases inside the tree, as Python would look members up),
functions, imports and module-level names."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class _Module:
    tree: ast.Module
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    functions: dict[str, ast.AST] = field(default_factory=dict)
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)
    """local name -> (module, name) of ``from module import name``."""
    star_imports: list[str] = field(default_factory=list)
    """Modules of ``from module import *``."""
    globals: set[str] = field(default_factory=set)


class VllmSources:
    """A vLLM source tree (the directory that holds ``vllm/``), read with ast."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._modules: dict[str, _Module | None] = {}

    def module(self, name: str) -> _Module | None:
        if name not in self._modules:
            self._modules[name] = self._parse(name)
        return self._modules[name]

    def _parse(self, name: str) -> _Module | None:
        base = self.root.joinpath(*name.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                break
        else:
            return None
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = _Module(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef):
                module.classes[node.name] = node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                module.functions[node.name] = node
            elif isinstance(node, ast.ImportFrom):
                source = _resolve_relative(package, node.module, node.level)
                for alias in node.names:
                    if alias.name == "*":
                        module.star_imports.append(source)
                    else:
                        module.imports[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    module.imports[local] = (alias.name, "")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        module.globals.add(target.id)
        return module

    def find_class(self, module_name: str, name: str, depth: int = 0
                   ) -> tuple[str, ast.ClassDef] | None:
        """The class ``name`` as seen from ``module_name`` (following imports)."""
        module = self.module(module_name)
        if module is None or depth > 8:
            return None
        if name in module.classes:
            return module_name, module.classes[name]
        if name in module.imports:
            source, original = module.imports[name]
            if original:
                return self.find_class(source, original, depth + 1)
        return None

    def find_function(self, module_name: str, name: str, depth: int = 0) -> ast.AST | None:
        module = self.module(module_name)
        if module is None or depth > 8:
            return None
        if name in module.functions:
            return module.functions[name]
        if name in module.imports:
            source, original = module.imports[name]
            if original:
                return self.find_function(source, original, depth + 1)
        for source in module.star_imports:
            found = self.find_function(source, name, depth + 1)
            if found is not None:
                return found
        return None

    def has_global(self, module_name: str, name: str) -> bool:
        module = self.module(module_name)
        if module is None:
            return False
        if (name in module.classes or name in module.functions or name in module.globals
                or name in module.imports):
            return True
        # ``vllm.envs`` resolves its variables in a module __getattr__ from a
        # table of names.
        return any(isinstance(node, ast.Constant) and node.value == name
                   for node in ast.walk(module.tree))

    def mro(self, module_name: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases found in the tree, depth first."""
        seen, order, stack = set(), [], [(module_name, cls)]
        while stack:
            mod, node = stack.pop(0)
            if (mod, node.name) in seen:
                continue
            seen.add((mod, node.name))
            order.append((mod, node))
            for base in node.bases:
                base_name = base.id if isinstance(base, ast.Name) else (
                    base.attr if isinstance(base, ast.Attribute) else None)
                if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name):
                    base_name = base.value.id
                if base_name is None:
                    continue
                found = self.find_class(mod, base_name)
                if found is not None:
                    stack.append(found)
        return order

    def member(self, module_name: str, class_name: str, member: str
               ) -> tuple[str, ast.AST] | None:
        """``(kind, node)`` of ``class_name.member``: kind ``method``,
        ``property``, ``field`` (class level) or ``instance`` (``self.x =``)."""
        found = self.find_class(module_name, class_name)
        if found is None:
            return None
        classes = self.mro(*found)
        for _, cls in classes:
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        node.name == member:
                    decorators = {_decorator_name(d) for d in node.decorator_list}
                    if decorators & {"property", "cached_property"}:
                        return "property", node
                    return "method", node
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                        and node.target.id == member:
                    return "field", node
                if isinstance(node, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == member for t in node.targets):
                    return "field", node
        for _, cls in classes:
            for node in ast.walk(cls):
                target = None
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                else:
                    continue
                for target in targets:
                    for item in (target.elts if isinstance(target, ast.Tuple) else [target]):
                        if (isinstance(item, ast.Attribute) and item.attr == member
                                and isinstance(item.value, ast.Name)
                                and item.value.id == "self"):
                            return "instance", node
        return None


def _top_level(tree: ast.Module):
    """Module-level statements, including those under ``if``/``try`` blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            stack[:0] = [*node.body, *getattr(node, "orelse", []),
                         *[s for h in getattr(node, "handlers", []) for s in h.body],
                         *getattr(node, "finalbody", [])]


def _resolve_relative(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _decorator_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _decorator_name(node.func)
    return ""
