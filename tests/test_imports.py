"""The import graph of ``sagm_jax``: no cycle, and the optimizers stand alone.

The graph is read from the source with ``ast``, every ``import`` and ``from ... import``
statement included (those inside functions too: a cycle deferred to call time is still
a cycle of design). An edge goes to the module an import names: ``from sagm_jax.data
import registry`` is an edge to ``sagm_jax.data.registry`` (Python runs
``sagm_jax/data/__init__.py`` on the way, but that is the package, not a dependency
the importing module chose), ``from sagm_jax.config import section`` an edge to
``sagm_jax.config``, and ``from sagm_jax import sagm`` (no submodule of that name) an
edge to the package's ``__init__``.
"""

from __future__ import annotations

import ast
import os

import sagm_jax

PACKAGE_DIR = os.path.dirname(os.path.abspath(sagm_jax.__file__))


def package_modules(package_dir: str = PACKAGE_DIR, package: str = "sagm_jax") -> dict[str, str]:
    """``{dotted module name: file}`` of every module below ``package_dir``; a package's
    ``__init__.py`` is the package's own name."""
    modules = {}
    for folder, _, files in os.walk(package_dir):
        relative = os.path.relpath(folder, package_dir)
        parts = [package] + ([] if relative == "." else relative.split(os.sep))
        for name in files:
            if name.endswith(".py"):
                stem = name[: -len(".py")]
                modules[".".join(parts if stem == "__init__" else parts + [stem])] = os.path.join(
                    folder, name
                )
    return modules


def _base_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from X import ...`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` (the text of ``module``) imports."""
    edges = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base_of(node, module, is_package)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        edges.update(name for name in names if name in known)
    return edges - {module}


def import_graph(package_dir: str = PACKAGE_DIR, package: str = "sagm_jax") -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``."""
    modules = package_modules(package_dir, package)
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            source = f.read()
        is_package = path.endswith("__init__.py")
        graph[module] = imported_modules(source, module, is_package, set(modules))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each group of modules that import each other
    (Tarjan's strongly connected components, then a path around each)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while not group or member != node:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_around(graph, group) for group in groups]


def _path_around(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A cycle inside ``group`` (modules that all reach each other), from its first name."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to start
        node = frontier.pop(0)
        for target in sorted(graph[node] & group):
            if target == start:
                return paths[node] + [start]
            if target not in paths:
                paths[target] = paths[node] + [target]
                frontier.append(target)
    raise AssertionError(f"{sorted(group)} is no strongly connected group")


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_optimizers_import_nothing_from_the_package_but_the_method_registry():
    # As optax knows nothing of configs: the update rules stand alone, with the registry
    # they enter themselves in, which imports nothing of the package.
    graph = import_graph()
    assert graph["sagm_jax.methods.update_rules"] == {"sagm_jax.methods.registry"}
    assert graph["sagm_jax.methods.registry"] == set()


def test_the_graph_sees_every_kind_of_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import thing\n")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "b.py").write_text("import pkg.sub.c\nfrom . import a\n")
    (package / "sub" / "__init__.py").write_text("from .b import x\n")
    (package / "sub" / "b.py").write_text("from pkg import sub\nfrom .. import thing\n")
    (package / "sub" / "c.py").write_text("import os\nfrom pkg.sub.b import y\n")
    assert import_graph(str(package), "pkg") == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub.b"},  # inside a function, to the named submodule
        "pkg.b": {"pkg.sub.c", "pkg.a"},
        "pkg.sub": {"pkg.sub.b"},
        "pkg.sub.b": {"pkg.sub", "pkg"},  # `thing` is no module: the package itself
        "pkg.sub.c": {"pkg.sub.b"},
    }
    # One group (pkg -> pkg.a -> pkg.sub.b -> pkg, and pkg.sub <-> pkg.sub.b), one path.
    assert cycles(import_graph(str(package), "pkg")) == [["pkg", "pkg.a", "pkg.sub.b", "pkg"]]


def test_a_cycle_is_printed_as_a_path_back_to_its_start():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_the_public_api_is_at_the_top_level():
    import sagm_jax
    from sagm_jax.methods import objectives, update_rules
    from sagm_jax.sweep import hparams
    from sagm_jax.averaging import valley

    for name in ("sagm", "sam", "gsam", "paper_optimizer"):
        assert getattr(sagm_jax, name) is getattr(update_rules, name)
    assert (sagm_jax.coral_penalty, sagm_jax.mmd_penalty) == (
        objectives.coral_penalty, objectives.mmd_penalty
    )
    assert sagm_jax.select_segments is valley.select_segments
    assert sagm_jax.random_hparams("sagm", "PACS", 3, 1, "coral") == hparams.random_hparams(
        "sagm", "PACS", 3, 1, "coral"
    )
    assert set(sagm_jax.__all__) >= {"sharpness", "load_run", "preprocess", "random_hparams"}
