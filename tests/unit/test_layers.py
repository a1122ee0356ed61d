"""The package's layers (docs/architecture.md, "Layers"), held by reading every module's imports.

Each module belongs to the component of its longest listed prefix; components sit in layers,
bottom first. A module may import its own component and any component of a lower layer; never a
higher layer, never a sibling component of its own layer (the scheduler and the worker learn
from each other only through the rules below them). Imports inside functions count; those under
``if TYPE_CHECKING:`` do not (annotations only). No two modules may import each other, directly
or around a longer loop, and the package imports itself inside a function only where the plugin's
load order or an optional dependency needs it, saying so on the line.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "h2o_vllm"

#: Bottom first; each inner tuple is one layer's sibling components.
LAYERS = (
    ("h2o_vllm.score_modes",),                             # one class per score mode: stdlib + torch
    ("foundation",),                                       # config, metrics, the package's version
    ("rules", "h2o_vllm.oracle"),                          # the shared rules; the independent oracle
    ("h2o_vllm.vllm_shims",),                              # named reads of vLLM's private symbols
    ("h2o_vllm.spec",),                                    # the KV-cache spec both sides share
    ("h2o_vllm.kernels",),                                 # Triton kernels and their torch twins
    ("h2o_vllm.scheduler", "h2o_vllm.worker"),             # engine core | worker: never each other
    ("h2o_vllm.kv_transfer",),                             # a feature over both sides
    ("h2o_vllm.frontend",),                                # process 0: flags, settings, requests
    ("h2o_vllm.vllm_hooks",),                              # installers: wrap vLLM, call the rest
    ("h2o_vllm.plugin",),                                  # vLLM's entry point
)
#: Components named by a list of modules rather than a prefix.
GROUPS = {"foundation": ("h2o_vllm", "h2o_vllm.config", "h2o_vllm.metrics"),
          "rules": ("h2o_vllm.policy", "h2o_vllm.budgets", "h2o_vllm.prefix_orders")}
#: Imports inside functions, of any module (today 19: 11 of Triton in the CPU test mode of the
#: CUDA path, 3 of NIXL, 4 of vLLM and 2 of the package in the plugin's entry point, vLLM's version
#: read where it is checked), and of the package itself.
MAX_IMPORTS_IN_FUNCTIONS = 20
MAX_OWN_IMPORTS_IN_FUNCTIONS = 2


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _component(module: str) -> str:
    for name, members in GROUPS.items():
        if module in members:
            return name
    prefixes = [c for layer in LAYERS for c in layer if c not in GROUPS]
    matches = [c for c in prefixes if module == c or module.startswith(c + ".")]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (docs/architecture.md, 'Layers')")
    return max(matches, key=len)


def _layer(component: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if component in layer)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str, path: Path, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package modules an import statement loads (``from p import m`` names module ``p.m``
    where there is one, else ``p``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            package = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith("h2o_vllm") and name != module:
            found.append(name)
    return found


def _imports(module: str, path: Path) -> list[tuple[str, int, bool, str]]:
    """(imported module, line, inside a function, the line's text) of each package import."""
    lines = path.read_text().splitlines()
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other, in_function)
                continue
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((target, child.lineno, inside, lines[child.lineno - 1])
                             for target in _resolve(module, path, child))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


IMPORTS = {module: _imports(module, path) for module, path in MODULES.items()}


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _component(module)


def test_no_import_goes_up_a_layer_or_across_to_a_sibling():
    wrong = []
    for module, imports in IMPORTS.items():
        mine = _component(module)
        for target, line, _, _ in imports:
            theirs = _component(target)
            if theirs != mine and _layer(theirs) >= _layer(mine):
                way = "up" if _layer(theirs) > _layer(mine) else "across"
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} ({way}: {mine} -> {theirs})")
    assert not wrong, "\n".join(wrong)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted({t for t, _, _, _ in imports}) for m, imports in IMPORTS.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_no_import_cycle():
    assert not _cycles()


def _imports_inside_functions(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every import inside a function, of any module."""
    lines = path.read_text().splitlines()
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child.lineno, lines[child.lineno - 1]))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def test_imports_inside_functions_are_few_and_say_why():
    """Only the plugin's load order (the version check before anything names vLLM's internals),
    an optional dependency (NIXL) or Triton's interpreter switch (set before Triton is imported)
    keep an import inside a function, each saying so on its line. Of the package's own: the two
    in ``plugin.register``."""
    inside = [(MODULES[m], line, text) for m in MODULES for line, text in _imports_inside_functions(MODULES[m])]
    unexplained = [f"{path.relative_to(ROOT)}:{line}" for path, line, text in inside if "#" not in text]
    assert not unexplained, "an import inside a function says why on its line: " + ", ".join(unexplained)
    assert len(inside) <= MAX_IMPORTS_IN_FUNCTIONS
    ours = [(m, line) for m, imports in IMPORTS.items() for _, line, in_function, _ in imports if in_function]
    assert len(set(ours)) <= MAX_OWN_IMPORTS_IN_FUNCTIONS


@pytest.mark.parametrize("source, expected", [
    ("from h2o_vllm.worker import plan\n", True),
    ("def f():\n    from h2o_vllm.worker.plan import StepPlan\n", True),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from h2o_vllm.worker import plan\n", False),
])
def test_the_reader_sees_imports_where_they_count(tmp_path, source, expected):
    """The checks above can fail: an edge from the scheduler to the worker is found at module
    level and inside a function, and left out under TYPE_CHECKING."""
    path = PACKAGE / "scheduler" / "manager.py"
    fake = tmp_path / "manager.py"
    fake.write_text(source)
    found = _imports("h2o_vllm.scheduler.manager", fake)
    assert bool(found) == expected
    if expected:
        target = found[0][0]
        assert _component(target) == "h2o_vllm.worker" and _layer(_component(target)) == _layer(
            _component(_module_name(path)))
