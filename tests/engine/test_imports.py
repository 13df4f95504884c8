"""The package's modules import each other without a cycle.

Read statically: every import a module runs when it is loaded (at the top
level, under ``if TYPE_CHECKING``, ``if`` or ``try``) is an edge; imports inside
functions are not, since they run after every module has loaded (the engine
imports ``distributed`` lazily, for instance). A cycle, even one guarded by
``TYPE_CHECKING``, means two modules that cannot be read apart.
"""

import ast
from pathlib import Path

import minipaged

PACKAGE_DIR = Path(minipaged.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def load_time_imports(body: list[ast.stmt]):
    """The import statements a module body runs when it is loaded."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            yield from load_time_imports(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from load_time_imports(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                yield from load_time_imports(handler.body)


def imported_modules(name: str) -> set[str]:
    """The package's modules that module ``name`` imports when it is loaded."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in load_time_imports(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            module = ".".join(base + [node.module] if node.module else base) if node.level \
                else node.module or ""
            # `from .pkg import mod` imports the submodule when there is one.
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES
                       else module for alias in node.names]
        found |= {t for t in targets if t in MODULES and t != name}
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_reader_sees_imports_as_python_runs_them():
    graph = {name: imported_modules(name) for name in MODULES}
    assert "minipaged.core.scheduler" in graph["minipaged.engine"]
    assert "minipaged.core.sequence" in graph["minipaged.core.scheduler"]
    assert "minipaged.models.layers" in graph["minipaged.executor.model_runner"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_through_others():
    graph = {name: imported_modules(name) for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
