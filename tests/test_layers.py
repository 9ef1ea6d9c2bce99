"""The package's import arrows point only downwards: no cycle anywhere, no module importing a layer above.

Read from the source with :mod:`ast`, without importing anything: every ``import`` and ``from ... import``
of a pipefisher module in a file, at module level or inside a function (a lazy import is still an
arrow), relative ones resolved, ``from package import submodule`` counted as an arrow to the submodule.
Imports under ``if TYPE_CHECKING:`` count too: they never run, but a type named from a layer above (or
round a cycle) is a dependency all the same, only hidden.
"""
from __future__ import annotations

import ast
import os
from typing import Iterator

import pipefisher

PACKAGE_DIR = os.path.dirname(os.path.abspath(pipefisher.__file__))

# Bottom to top. A module belongs to the layer of the longest prefix here that names it or a package
# above it; it may import its own layer and the layers below, never one above. K-FAC and the runtime
# (torch) sit above every scheduling layer, so the scheduling path cannot reach torch.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations", ("pipefisher", "pipefisher.errors", "pipefisher.safe_io", "pipefisher.pipeline_orders",
                     "pipefisher.bundled")),
    ("schedule: timelines", ("pipefisher.schedule.timeline",)),
    ("schedule: the problem and the label grammar", ("pipefisher.schedule.problem", "pipefisher.schedule.format")),
    ("schedule: packed schedules and their files", ("pipefisher.schedule",)),
    ("simulation", ("pipefisher.sim",)),
    ("rules", ("pipefisher.rules",)),
    ("cost", ("pipefisher.cost",)),
    ("policies", ("pipefisher.policies",)),
    ("outputs", ("pipefisher.outputs",)),
    ("the closed loop", ("pipefisher.loop",)),
    ("kfac", ("pipefisher.kfac",)),
    ("runtime: the job", ("pipefisher.runtime", "pipefisher.runtime.job")),
    ("runtime: models", ("pipefisher.runtime.models",)),
    ("runtime: data", ("pipefisher.runtime.data",)),
    ("runtime: pipeline", ("pipefisher.runtime.pipeline",)),
    ("runtime: training", ("pipefisher.runtime.train",)),
    ("runtime: launch and the library entry points", ("pipefisher.runtime.launch", "pipefisher.runtime.api",
                                                       "pipefisher.runtime.torch_pp")),
    ("cli", ("pipefisher.cli", "pipefisher.__main__")),
)


def _modules() -> dict[str, tuple[str, bool]]:
    """Module name -> (file, is a package), for every module of the package."""
    root = os.path.dirname(PACKAGE_DIR)
    out = {}
    for folder, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                package = parts[-1] == "__init__"
                out[".".join(parts[:-1] if package else parts)] = (os.path.join(folder, f), package)
    return out


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in the tree, at any depth (under ``if TYPE_CHECKING:`` too)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported pipefisher module: the line of its first import}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, (path, package) in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        arrows: dict[str, int] = {}
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".") if package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in targets:
                if target.split(".")[0] != "pipefisher" or target == name:
                    continue
                assert target in modules, f"{name} (line {node.lineno}) imports {target}, which is no module"
                arrows.setdefault(target, node.lineno)
        graph[name] = arrows
    return graph


def layer_of(module: str) -> int:
    best, where = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), i
    assert where is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return where


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, {})):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_every_module_is_in_a_layer() -> None:
    for module in import_graph():
        layer_of(module)


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_import_goes_to_the_same_or_a_lower_layer() -> None:
    upward = []
    for module, arrows in sorted(import_graph().items()):
        for target, line in sorted(arrows.items()):
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} (line {line}, layer '{LAYERS[layer_of(module)][0]}') imports {target} "
                              f"(layer '{LAYERS[layer_of(target)][0]}')")
    assert not upward, "imports from a layer above:\n" + "\n".join(upward)


def test_the_checks_see_what_they_must() -> None:
    """The walk finds lazy imports and TYPE_CHECKING ones; a cycle is found; the layers are ordered."""
    graph = import_graph()
    assert "pipefisher.runtime.job.dist" in graph["pipefisher.runtime.api"]
    assert "pipefisher.rules" in graph["pipefisher.cli.validate"]  # imported inside the command function
    assert "pipefisher.runtime.train.trainer" in graph["pipefisher.runtime.launch.local"]  # under TYPE_CHECKING
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert layer_of("pipefisher.runtime.pipeline.engine") > layer_of("pipefisher.rules.groups")
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    assert [n.names[0].name for n in _imports(tree) if isinstance(n, ast.Import)] == ["a", "b", "c"]


ENTRY_POINTS = ("pipefisher.runtime.launch.child",)
"""Modules under the runtime that are a process's ``__main__``: their own output is theirs to write (the
local launcher's worker writes its error and summary lines for the launcher)."""


def test_the_runtime_and_kfac_log_and_never_print() -> None:
    """No module under ``pipefisher.runtime`` or ``pipefisher.kfac`` imports click or calls ``print``: they log
    (``logging.getLogger(__name__)``), and showing the lines is the CLI's (:mod:`pipefisher.cli._progress`),
    so a library user's stdout stays theirs."""
    found = []
    for name, (path, _) in sorted(_modules().items()):
        if name.split(".")[:2] not in (["pipefisher", "runtime"], ["pipefisher", "kfac"]):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in _imports(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{name} (line {node.lineno}) imports {m}" for m in modules if m.split(".")[0] == "click"]
        if name not in ENTRY_POINTS:
            found += [f"{name} (line {node.lineno}) calls print" for node in ast.walk(tree)
                      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]
    assert not found, "\n".join(found)


ROOT_MODULES_AT_MOST = 6
"""The package root holds only what every layer shares; the scheduling path's steps are folders
(``schedule``, ``sim``, ``rules``, ``cost``, ``policies``, ``outputs``, ``loop``) that show its flow."""


def test_the_package_root_holds_few_modules() -> None:
    root = sorted(f for f in os.listdir(PACKAGE_DIR) if f.endswith(".py"))
    assert len(root) <= ROOT_MODULES_AT_MOST, f"{len(root)} modules at the package root: {', '.join(root)}"


def test_each_name_means_one_thing() -> None:
    """No two modules, and no two folders, of the package share a name (``__init__`` aside): a name
    such as ``drift`` or ``data`` names one thing, wherever it is read."""
    seen: dict[tuple[str, str], list[str]] = {}
    for folder, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, PACKAGE_DIR)
        for d in dirs:
            seen.setdefault(("folder", d), []).append(os.path.join(rel, d))
        for f in files:
            if f.endswith(".py") and f != "__init__.py":
                seen.setdefault(("module", f), []).append(os.path.join(rel, f))
    doubled = [f"{kind} {name}: {', '.join(sorted(paths))}" for (kind, name), paths in sorted(seen.items())
               if len(paths) > 1]
    assert not doubled, "names used twice:\n" + "\n".join(doubled)


LONGEST_FUNCTION = 150
"""Lines at most in any function of the package: a longer one is named steps (a small class holding its
state, or helper functions), which a reader can take one at a time."""


def long_functions(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each function or method in ``tree`` over :data:`LONGEST_FUNCTION` lines."""
    return [(n.name, n.lineno, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno is not None and n.end_lineno - n.lineno + 1 > LONGEST_FUNCTION]


def test_no_function_is_over_150_lines() -> None:
    found = []
    for name, (path, _) in sorted(_modules().items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        found += [f"{name}:{fn} (line {line}) has {lines} lines" for fn, line, lines in long_functions(tree)]
    assert not found, "\n".join(found)


def test_the_length_check_sees_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST_FUNCTION))
    assert long_functions(ast.parse(f"def f():\n{body}\n")) == [("f", 1, LONGEST_FUNCTION + 1)]
    assert long_functions(ast.parse(f"def f():\n{body[:body.rindex(chr(10))]}\n")) == []
