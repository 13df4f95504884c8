"""The package's import graph: no cycle, and no arrow against the layers.

Two graphs are read statically from the source:

- The load-time graph: every import a module runs when it is loaded (at the
  top level, under ``if TYPE_CHECKING``, ``if`` or ``try``). A cycle there,
  even one guarded by ``TYPE_CHECKING``, means two modules that cannot be
  read apart.
- The whole graph: every import anywhere, functions included (the engine
  imports the distributed executor lazily, a benchmark imports the engine
  inside ``main``). A lazy import is still a dependency: each one must go
  from a higher layer to a lower one, as ``LAYERS`` below allows.
"""

import ast
from pathlib import Path

import minipaged

PACKAGE_DIR = Path(minipaged.__file__).parent

# Each unit (a subpackage, or a module at the package's top level) and the
# units it may import. Lower layers first; a unit never imports one that
# lists it. This table is the layering rule the README's "Where does my
# change go" describes.
BASE = {"config", "sampling_params", "outputs"}    # settings and public data types
LAYERS: dict[str, set[str]] = {
    "kernels": set(),                                # Triton kernels and torch references
    "config": {"kernels"},                           # checks a backend name against kernels
    "sampling_params": set(),
    "outputs": set(),
    "core": {"config"},                              # memory and scheduling: no tensors, no models
    "distributed": {"config"},                       # process groups, torchrun, pipeline split
    "quantization": {"kernels"},                     # quantized layouts, their GEMMs and layers
    "models": {"kernels", "config", "distributed", "quantization"},
    "postprocess": {"core"} | BASE,
    "sampling": {"core", "postprocess"} | BASE,
    # drafts and their verification; a draft model runs on an executor of its own
    "spec_decode": {"core", "sampling", "postprocess", "executor", "models",
                    "quantization"} | BASE,
    # The profile pass that sizes the pool runs the sampler once.
    "executor": {"core", "models", "kernels", "distributed", "sampling", "quantization"} | BASE,
    "engine_args": {"config", "kernels", "quantization"},
    "tool_calling": set(),                           # tools, call parsers, chat templates
    "input_processor": {"core", "models", "sampling", "postprocess", "tool_calling"} | BASE,
    "engine": {"core", "executor", "models", "distributed", "sampling", "postprocess",
               "spec_decode", "engine_args", "input_processor", "quantization"} | BASE,
    "llm": {"engine", "engine_args", "input_processor", "tool_calling"} | BASE,
    "async_engine": {"engine", "engine_args", "input_processor"} | BASE,
    "assets": {"models"},                            # the shipped models and their paths
    # The server sees the engine side through its public API only
    # (tests/server/test_server_public_api.py checks which attributes).
    "server": {"engine", "async_engine", "engine_args", "input_processor", "assets",
               "tool_calling"} | BASE,
}
BELOW_SERVER = set(LAYERS) - {"server"}
LAYERS |= {
    "bench": BELOW_SERVER | {"minipaged"},           # the benchmarks users run
    "teaching": BELOW_SERVER | {"bench"},            # demo, traces, pictures
    "minipaged": {"core", "engine_args", "llm"} | BASE,   # the package's __init__: the public API
}
LAYERS |= {"cli": set(LAYERS) - {"cli"}, "__main__": set(LAYERS) | {"cli"}}


def module_name(path: Path, root: Path = PACKAGE_DIR) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
SOURCES = {name: path.read_text() for name, path in MODULES.items()}


def unit_of(name: str) -> str:
    """``minipaged.core.scheduler`` -> ``core``; ``minipaged.engine`` -> ``engine``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


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


def all_imports(tree: ast.Module):
    """Every import statement of a module, inside functions and classes too."""
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def targets(node, name: str, modules) -> set[str]:
    """The package's modules that one import statement of module ``name`` names."""
    is_package = name.count(".") == 0 or modules.get(name, Path("x.py")).name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    if isinstance(node, ast.Import):
        found = [alias.name for alias in node.names]
    else:
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        module = ".".join(base + [node.module] if node.module else base) if node.level \
            else node.module or ""
        # `from .pkg import mod` imports the submodule when there is one.
        found = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules
                 else module for alias in node.names]
    return {t for t in found if t in modules and t != name}


def imported_modules(name: str, everywhere: bool = False, sources=None, modules=None
                     ) -> set[str]:
    """The package's modules that module ``name`` imports when it is loaded
    (``everywhere``: anywhere in its source, functions included)."""
    sources, modules = sources or SOURCES, modules or MODULES
    tree = ast.parse(sources[name])
    nodes = all_imports(tree) if everywhere else load_time_imports(tree.body)
    return set().union(*(targets(n, name, modules) for n in nodes))


def layering_violations(sources: dict[str, str], modules) -> list[str]:
    """``"a.b -> c.d (unit x may not import unit y)"`` for every import, at
    module level or inside a function, that ``LAYERS`` does not allow; and a
    line for every unit the table does not list."""
    problems = []
    for name in sorted(sources):
        unit = unit_of(name)
        if unit not in LAYERS:
            problems.append(f"{name}: unit {unit!r} is not in LAYERS (add it, with what it "
                            f"may import)")
            continue
        for target in sorted(imported_modules(name, True, sources, modules)):
            other = unit_of(target)
            if other != unit and other not in LAYERS[unit]:
                problems.append(f"{name} -> {target} (unit {unit!r} may not import {other!r})")
    return problems


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
    # A lazy import counts in the whole graph only.
    lazy = imported_modules("minipaged.executor.executor", everywhere=True)
    assert "minipaged.executor.driver" in lazy
    assert "minipaged.executor.driver" not in graph["minipaged.executor.executor"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_through_others():
    graph = {name: imported_modules(name) for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_import_goes_down_the_layers():
    problems = layering_violations(SOURCES, MODULES)
    assert not problems, "imports against the layering table:\n" + "\n".join(problems)


def test_a_planted_wrong_import_is_reported():
    """The check itself: core importing the executor inside a function, a
    model importing the server at the top, and a unit nobody listed."""
    sources = dict(SOURCES)
    modules = dict(MODULES)
    planted = {
        "minipaged.core.planted": "def f():\n    from ..executor.model_runner import ModelRunner\n",
        "minipaged.models.planted": "from minipaged.server import routes\n",
        "minipaged.newroom.planted": "x = 1\n",
    }
    for name, source in planted.items():
        sources[name] = source
        modules[name] = PACKAGE_DIR / (name.split(".", 1)[1].replace(".", "/") + ".py")
    problems = layering_violations(sources, modules)
    assert any(p.startswith("minipaged.core.planted -> minipaged.executor.model_runner")
               for p in problems), problems
    assert any(p.startswith("minipaged.models.planted -> minipaged.server.routes")
               for p in problems), problems
    assert any(p.startswith("minipaged.newroom.planted: unit 'newroom'") for p in problems)
    assert len(problems) == 3, problems   # nothing else: the real tree is clean


def test_the_top_level_holds_few_modules():
    """Everything but the front door lives in a subpackage named for its role."""
    top = sorted(p.stem for p in PACKAGE_DIR.glob("*.py"))
    assert len(top) <= 12, f"{len(top)} modules at minipaged/'s top level: {top}"
