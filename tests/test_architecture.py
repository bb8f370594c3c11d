"""The serving packages' layering, read from the source with ``ast`` (nothing is imported).

    modeling                        the model, its paged KV cache, the engine; imports none of the others
    kv_transfer                     moves a prompt's KV between workers; imports modeling
    prefill_worker, decode_worker   the workers; import modeling and kv_transfer
    controller                      the control plane (config, placement, routing, migration, scaling);
                                    imports the layers above, never planner or frontend
    planner                         the offline and online planners and the simulator; may import
                                    controller and the layers above, never frontend
    frontend                        the gRPC and HTTP servers, the client and the CLI; may import every
                                    other package

Every import counts: at the top of a module, inside a function, under ``if TYPE_CHECKING:``; relative
imports are resolved against the importing module. :func:`import_graph` gives the module-level graph.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("modeling", "kv_transfer", "prefill_worker", "decode_worker", "controller", "planner", "frontend")
# package -> the other serving packages it may import
ALLOWED = {
    "modeling": set(),
    "kv_transfer": {"modeling"},
    "prefill_worker": {"modeling", "kv_transfer"},
    "decode_worker": {"modeling", "kv_transfer"},
    "controller": {"modeling", "kv_transfer", "prefill_worker", "decode_worker"},
    "planner": {"modeling", "kv_transfer", "prefill_worker", "decode_worker", "controller"},
    "frontend": {"modeling", "kv_transfer", "prefill_worker", "decode_worker", "controller", "planner"},
}


def modules(root: str = ROOT) -> dict[str, str]:
    """Module name -> source path, for every ``.py`` file of the serving packages."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    out[module.removesuffix(".__init__")] = path
    return out


def imports(module: str, path: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the module: ``import a.b`` gives ``a.b``; ``from a import b``
    gives ``a.b`` (a module or a name in ``a``); relative imports resolved."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    """Module -> the serving packages' modules it imports (a name imported from a module counts as that
    module; importing a package counts as its ``__init__``)."""
    found = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in found.items():
        targets = {resolve(name) for _, name in imports(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def violations(package: str, root: str = ROOT) -> list[str]:
    """Each import of a serving package that ``package`` may not import, as "module (path:line) imports name"."""
    forbidden = set(PACKAGES) - ALLOWED[package] - {package}
    return [f"{module} ({os.path.relpath(path, root)}:{line}) imports {name}"
            for module, path in sorted(modules(root).items()) if module.split(".")[0] == package
            for line, name in imports(module, path) if name.split(".")[0] in forbidden]


def test_every_package_is_read():
    found = {module.split(".")[0] for module in modules()}
    assert found == set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_layering(package):
    found = violations(package)
    allowed = ", ".join(sorted(ALLOWED[package])) or "none of the others"
    assert not found, f"{package} may import only {allowed}:\n  " + "\n  ".join(found)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: each strongly connected set of two or more modules, sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


MAX_CLASS_LINES = 400  # a class past this does more than one job: split it along its jobs


def test_no_import_cycle_counting_type_checking_imports():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself
    found = cycles(import_graph())
    assert not found, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def test_no_class_over_the_size_limit():
    large = []
    for module, path in sorted(modules().items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        large += [f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(tree)
                  if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not large, f"classes over {MAX_CLASS_LINES} lines:\n  " + "\n  ".join(large)
