"""The package's layers (docs/design.md, "Package layout"): imports only point down,
counting imports inside functions and imports of a package ``__init__``; the
two features never import each other; the shared layer and the algorithms
import no vLLM (only the modules that hook into it do). No module runs past
450 lines, no function past 80 without a comment saying why, and only
``patches/`` swaps a class or rebinds a method on vLLM's objects."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_specextend"

# Lowest first; a module may import its own layer and the layers below it.
LAYERS = [
    ("utilities", ["vllm_specextend.log", "vllm_specextend.post_import"]),
    ("common", ["vllm_specextend.common"]),
    ("features", ["vllm_specextend.retrieval", "vllm_specextend.control"]),
    ("adapters", ["vllm_specextend.drafters", "vllm_specextend.metrics"]),
    ("patches", ["vllm_specextend.patches"]),
    ("plugin entry", ["vllm_specextend"]),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """Index of the most specific layer prefix that holds ``module``."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, module
    return best


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth; ``from A
    import b`` imports ``A``, and ``A.b`` too when that is a module."""
    tree = ast.parse(path.read_text())
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            found.append((node.lineno, node.module))
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def check_imports_point_down(here: str, path: Path) -> None:
    own = layer_of(here)
    for line, target in imported_modules(path):
        if not target.startswith("vllm_specextend"):
            continue
        assert target != "vllm_specextend" or here == "vllm_specextend", (
            f"{path.name}:{line} imports the package __init__"
        )
        assert layer_of(target) <= own, (
            f"{here} ({LAYERS[own][0]}) imports {target} ({LAYERS[layer_of(target)][0]}) "
            f"at line {line}: imports must point down"
        )


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_point_down(path):
    check_imports_point_down(module_name(path), path)


FEATURES = ("vllm_specextend.retrieval", "vllm_specextend.control")
VLLM_HOOKS = ("vllm_specextend/retrieval/owner.py", "vllm_specextend/retrieval/layer_hooks.py")
"""The features' modules that import vLLM: retrieval's hooks on its layers."""


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_the_features_never_import_each_other(path):
    here = module_name(path)
    own = next((feature for feature in FEATURES if here.startswith(feature)), None)
    if own is None:
        return
    for line, target in imported_modules(path):
        other = next((feature for feature in FEATURES if target.startswith(feature)), own)
        assert other == own, f"{here}:{line} imports {target}: the features are independent"


ALGORITHMS = sorted(p for folder in ("common", "retrieval", "control")
                    for p in (PACKAGE / folder).rglob("*.py")
                    if str(p.relative_to(PACKAGE.parent)) not in VLLM_HOOKS)


@pytest.mark.parametrize("path", ALGORITHMS, ids=lambda p: module_name(p))
def test_the_shared_layer_and_the_algorithms_import_no_vllm(path):
    for line, target in imported_modules(path):
        assert target.split(".")[0] != "vllm", f"{path.name}:{line} imports {target}"


@pytest.mark.parametrize("source", [
    "def f():\n    from vllm_specextend.retrieval.owner import DraftRetrieval\n",
    "from vllm_specextend import log\n",
])
def test_the_check_catches_upward_and_package_imports(tmp_path, source):
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    with pytest.raises(AssertionError, match="imports"):
        check_imports_point_down("vllm_specextend.common.fake", fake)


# ---- sizes, and where vLLM's objects are changed ----------------------------------

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
LONG_FUNCTION_REASON = "# Over 80 lines"
"""The comment, on the line above a longer function, that says why it is long."""


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_no_module_runs_past_450_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, (
        f"{module_name(path)} has {lines} lines: split it by concern")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_no_function_runs_past_80_lines_without_a_reason(path):
    source = path.read_text().splitlines()
    for node in ast.walk(ast.parse("\n".join(source))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            reason = source[first - 2].strip().startswith(LONG_FUNCTION_REASON)
            assert length <= MAX_FUNCTION_LINES or reason, (
                f"{path.name}:{node.lineno} {node.name} has {length} lines and no "
                f"'{LONG_FUNCTION_REASON} ...' comment above it saying why")


PATCHES = "vllm_specextend.patches"


def swaps_outside_patches(path: Path) -> list[str]:
    """Where the file assigns an object's ``__class__``, rebinds a method of
    another object to a function it defines (``manager.capture = f``), or
    does either through ``setattr``: what only ``patches/`` may do to vLLM."""
    tree = ast.parse(path.read_text())
    local_functions = {node.name for node in ast.walk(tree)
                       if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if not isinstance(target, ast.Attribute):
                    continue
                rebinds = (isinstance(node.value, ast.Name)
                           and node.value.id in local_functions
                           and not (isinstance(target.value, ast.Name)
                                    and target.value.id in ("self", "cls")))
                if target.attr == "__class__" or rebinds:
                    found.append(f"{path.name}:{node.lineno} assigns {target.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr"):
            found.append(f"{path.name}:{node.lineno} calls setattr")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_only_the_patches_swap_classes_or_rebind_methods(path):
    if module_name(path).startswith(PATCHES):
        return
    assert swaps_outside_patches(path) == []


@pytest.mark.parametrize("source", [
    "def f(layer, cls):\n    layer.impl.__class__ = cls\n",
    "def f(manager):\n    def replay(desc):\n        pass\n    manager.run_fullgraph = replay\n",
    "def f(owner, wrapper):\n    setattr(owner, 'forward', wrapper)\n",
])
def test_the_swap_check_catches_class_swaps_and_rebinding(tmp_path, source):
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    assert swaps_outside_patches(fake)
