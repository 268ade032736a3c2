"""The check: each :class:`~vllm_specextend.vllm_api.manifest.Expect` of the
manifest against a vLLM source tree, and the report."""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_specextend.vllm_api.manifest import MANIFEST, Expect
from vllm_specextend.vllm_api.sources import VllmSources


def _parameters(function: ast.AST) -> tuple[list[str], set[str], bool]:
    """(positional parameter names without ``self``, every name, has **kwargs)."""
    args = function.args  # type: ignore[attr-defined]
    positional = [a.arg for a in [*args.posonlyargs, *args.args]]
    if positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    names = set(positional) | {a.arg for a in args.kwonlyargs}
    return positional, names, args.kwarg is not None


def _check_signature(expect: Expect, function: ast.AST) -> str | None:
    positional, names, _ = _parameters(function)
    if expect.params and positional[: len(expect.params)] != list(expect.params):
        return (f"parameters start {positional[: len(expect.params) + 2]}, expected "
                f"{list(expect.params)}")
    missing = [k for k in expect.keywords if k not in names]
    if missing:
        return f"no parameter(s) {missing} (has {sorted(names)})"
    return None


def _references(function: ast.AST, name: str) -> bool:
    return any(isinstance(node, ast.Name) and node.id == name for node in ast.walk(function))


def check(sources: VllmSources, manifest: list[Expect] = MANIFEST) -> list[str]:
    """One line per expectation the tree does not meet (empty: all met)."""
    problems = []
    for expect in manifest:
        problem = _check_one(sources, expect)
        if problem is not None and not expect.optional:
            problems.append(f"{expect.module}.{expect.name} ({expect.kind}; {expect.why}): "
                            f"{problem}")
    return problems


def _check_one(sources: VllmSources, expect: Expect) -> str | None:
    if sources.module(expect.module) is None:
        return "module not found"
    if expect.kind == "module":
        return None
    if expect.kind == "class":
        return None if sources.find_class(expect.module, expect.name) else "no such class"
    if expect.kind == "function":
        function = sources.find_function(expect.module, expect.name)
        if function is None:
            return "no such function"
        return _check_signature(expect, function)
    if expect.kind == "global":
        if not sources.has_global(expect.module, expect.name):
            return "no such module-level name"
        if expect.used_in is not None:
            class_name, _, method = expect.used_in.partition(".")
            found = sources.member(expect.module, class_name, method)
            if found is None or not _references(found[1], expect.name):
                return f"not looked up in {expect.used_in} (a swap would not take effect)"
        return None
    class_name, _, member = expect.name.partition(".")
    found = sources.member(expect.module, class_name, member)
    if found is None:
        return f"no {expect.kind} {member!r} on {class_name} or its bases"
    kind, node = found
    if expect.kind == "method":
        if kind != "method":
            return f"is a {kind}, expected a method"
        return _check_signature(expect, node)
    return None


def absent_optional(sources: VllmSources, manifest: list[Expect] = MANIFEST) -> list[str]:
    """The optional names this tree does not have (fine: checked at run time)."""
    return [f"{e.module}.{e.name}" for e in manifest
            if e.optional and _check_one(sources, e) is not None]


def format_report(problems: list[str], root: Path, version: str | None,
                  optional_absent: list[str] = ()) -> str:
    lines = [f"vLLM sources: {root}" + (f" (vLLM {version})" if version else ""),
             f"expectations: {len(MANIFEST)}; unmet: {len(problems)}"]
    lines += [f"  UNMET {p}" for p in problems]
    lines += [f"  absent, optional: {name}" for name in optional_absent]
    return "\n".join(lines)


def source_version(root: Path) -> str | None:
    """The version a source tree declares (``vllm/_version.py``), if any."""
    path = Path(root) / "vllm" / "_version.py"
    if not path.is_file():
        return None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id in ("__version__", "version")
                for t in node.targets) and isinstance(node.value, ast.Constant):
            return str(node.value.value)
    return None
