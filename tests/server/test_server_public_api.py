"""The server reaches the engine through its public side only.

An AST walk over every module of ``minipaged/server/`` finds each attribute
taken from an *engine object* and fails on any that ``ALLOWED`` does not list
for that object's kind. Engine objects, as the server's code names them:

* ``engine``: the names ``engine``, ``core``, ``async_engine``,
  ``llm_engine``, ``aengine``, ``LLMEngine``, ``AsyncLLMEngine``, any
  attribute of those names (``state.engine``, ``self.engine``,
  ``app.state.engine``, ``state.core``), and parameters annotated
  ``LLMEngine`` or ``AsyncLLMEngine``;
* ``input_processor``: the name ``input_processor``, ``X.input_processor``,
  and parameters annotated ``InputProcessor``;
* ``stats``: the name ``stats``, ``X.stats``, and parameters annotated
  ``EngineStats``;

plus any name a module assigns one of these to (``ip = state.input_processor``).
``getattr``/``hasattr``/``setattr`` with a constant name count as attributes.
So ``state.core.tokenizer``, ``engine.scheduler.running``,
``getattr(engine.block_manager, "cpu_pool")``, ``core.validate_prompt``,
``engine.model_config`` and ``engine._anything`` are all reported; the
self-checks below plant them and expect exactly that.

What an engine object's attributes lead to is not followed further unless it
is itself an engine object (``engine.engine``, ``engine.input_processor``,
``engine.stats``): the step hook's ``scheduler_output`` and the
``RequestOutput``s the engine yields are the public data they carry.
"""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import minipaged
from minipaged.async_engine import AsyncLLMEngine
from minipaged.engine import EngineStats, LLMEngine
from minipaged.input_processor import InputProcessor

SERVER_DIR = Path(minipaged.__file__).parent / "server"

# -- the allowed list, written once ------------------------------------------------------------

ALLOWED = {
    "engine": {
        # AsyncLLMEngine's public side
        "engine",                     # the LLMEngine it drives: the metrics' step hook goes there
        "generate", "abort", "start", "shutdown", "is_running", "num_unfinished_requests",
        # its bounds, and the drain of a graceful shutdown (server/lifecycle.py)
        "submit", "check_bounds", "check_admission", "begin_drain", "draining", "end_all",
        "max_queued_requests", "max_stream_backlog", "request_timeout_s",
        # LLMEngine's public methods and attributes
        "from_engine_args", "add_request", "abort_request", "step", "close",
        "has_unfinished_requests", "get_num_unfinished_requests", "has_request",
        "default_sampling_params",
        "step_hooks",                 # hook(engine, scheduler_output, outputs) after each step
        "engine_args",                # the options it was built with (cache_config_info's labels)
        # both
        "stats", "input_processor",
    },
    "input_processor": {
        "has_tokenizer", "vocab_size", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "scheduling_policy", "eos_token_id", "extra_eos_token_ids",
        "end_token_ids", "default_sampling_params",
        "tokenize", "decode", "token_text", "render_chat",
        "validate_prompt", "validate_params", "validate_priority", "compile_grammar",
        "process", "beam_state", "grammar_matcher",
    },
    "stats": {f.name for f in dataclasses.fields(EngineStats)},
}

KIND_OF_NAME = {name: "engine" for name in ("engine", "core", "async_engine", "llm_engine",
                                            "aengine", "LLMEngine", "AsyncLLMEngine")}
KIND_OF_NAME |= {"input_processor": "input_processor", "stats": "stats"}
KIND_OF_TYPE = {"LLMEngine": "engine", "AsyncLLMEngine": "engine",
                "InputProcessor": "input_processor", "EngineStats": "stats"}
ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


# -- the walk ----------------------------------------------------------------------------------

def annotation_kind(annotation: ast.expr | None) -> str | None:
    """The engine kind an annotation names (``LLMEngine``, ``"InputProcessor"``,
    ``AsyncLLMEngine | LLMEngine``), else None."""
    if annotation is None:
        return None
    text = (annotation.value if isinstance(annotation, ast.Constant)
            and isinstance(annotation.value, str) else ast.unparse(annotation))
    words = text.replace("|", " ").replace("[", " ").replace("]", " ").replace(",", " ").split()
    return next((KIND_OF_TYPE[w.rpartition(".")[2]] for w in words
                 if w.rpartition(".")[2] in KIND_OF_TYPE), None)


class EngineAttributes:
    """One module's engine objects, and every attribute taken from one."""

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.names = dict(KIND_OF_NAME)
        for node in ast.walk(tree):   # annotated parameters
            if isinstance(node, ast.arg) and (kind := annotation_kind(node.annotation)):
                self.names.setdefault(node.arg, kind)
        self._follow_assignments()

    def kind(self, node: ast.expr) -> str | None:
        """The engine kind of the object ``node`` evaluates to, else None."""
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.kind(node.value)
            if base is not None:   # what an engine object's attribute is
                return KIND_OF_NAME.get(node.attr) if node.attr in ("engine", "input_processor",
                                                                    "stats") else None
            return KIND_OF_NAME.get(node.attr)   # state.engine, self.engine, state.core, ...
        return None

    def _follow_assignments(self) -> None:
        """Names a module binds to an engine object are engine objects too."""
        changed = True
        while changed:
            changed = False
            for node in ast.walk(self.tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
                    targets = (node.targets if isinstance(node, ast.Assign) else [node.target])
                    kind = self.kind(node.value) if node.value is not None else None
                    if isinstance(node, ast.AnnAssign):
                        kind = kind or annotation_kind(node.annotation)
                elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                    targets, kind = [node.optional_vars], self.kind(node.context_expr)
                else:
                    continue
                for target in targets:
                    if kind and isinstance(target, ast.Name) and target.id not in self.names:
                        self.names[target.id] = kind
                        changed = True

    def taken(self):
        """``(line, kind, attribute, source)`` of each attribute taken from an engine object."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and (kind := self.kind(node.value)):
                yield node.lineno, kind, node.attr, ast.unparse(node)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ATTRIBUTE_FUNCTIONS and len(node.args) >= 2
                  and (kind := self.kind(node.args[0]))
                  and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):
                yield node.lineno, kind, node.args[1].value, ast.unparse(node)


def violations(source: str, filename: str = "<planted>") -> list[str]:
    """``file:line: source (kind.attribute)`` for each attribute ``ALLOWED`` does not list."""
    found = sorted((line, text, kind, attribute)
                   for line, kind, attribute, text in EngineAttributes(ast.parse(source)).taken()
                   if attribute.startswith("_") or attribute not in ALLOWED[kind])
    return [f"{filename}:{line}: {text} ({kind}.{attribute})"
            for line, text, kind, attribute in found]


def server_modules() -> list[Path]:
    return sorted(SERVER_DIR.rglob("*.py"))


# -- the server ----------------------------------------------------------------------------

def test_the_server_uses_only_the_engines_public_side():
    assert len(server_modules()) >= 7   # app, background, cli, constraints, metrics, ...
    found = [v for path in server_modules()
             for v in violations(path.read_text(), str(path.relative_to(SERVER_DIR.parent)))]
    assert found == [], "the server reaches past the engine's public API:\n" + "\n".join(found)


def test_the_walk_sees_the_servers_engine_objects():
    """Not vacuous: the server's modules do take attributes from engine objects,
    and from each kind."""
    kinds = {kind for path in server_modules()
             for _, kind, _, _ in EngineAttributes(ast.parse(path.read_text())).taken()}
    assert kinds == {"engine", "input_processor", "stats"}


SERVER_MAY_IMPORT = {"minipaged.async_engine", "minipaged.engine", "minipaged.engine_args",
                     "minipaged.input_processor", "minipaged.sampling_params",
                     "minipaged.outputs", "minipaged.assets",
                     "minipaged.tool_calling"}   # tools and parsers: no engine in it


def test_the_server_imports_no_engine_internals():
    """Nothing from the scheduler, block manager, executor, sampler, models or
    configs: the server's modules import the engine's public modules and each other."""
    bad = []
    for path in server_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ["minipaged", "server"][:3 - node.level] if node.level <= 2 else []
                module = ".".join(base + ([node.module] if node.module else []))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                module = next((n for n in names if n.startswith("minipaged")), "")
            else:
                continue
            if module.startswith("minipaged") and not module.startswith("minipaged.server") \
                    and module not in SERVER_MAY_IMPORT:
                bad.append(f"{path.name}:{node.lineno}: {module}")
    assert bad == []


# -- the allowed list names what exists ----------------------------------------------------

def instance_attributes(cls: type) -> set[str]:
    """The ``self.x = ...`` names of a class's methods."""
    tree = ast.parse(inspect.getsource(cls))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


def test_every_allowed_name_is_public_api():
    engine_side = set()
    for cls in (LLMEngine, AsyncLLMEngine):
        engine_side |= {n for n in dir(cls) if not n.startswith("_")} | instance_attributes(cls)
    assert ALLOWED["engine"] <= engine_side, ALLOWED["engine"] - engine_side
    public_inputs = {n for n in dir(InputProcessor) if not n.startswith("_")}
    assert ALLOWED["input_processor"] <= public_inputs, ALLOWED["input_processor"] - public_inputs
    # What the engine objects must never hand the server, whatever else the list allows.
    never = {"tokenizer", "scheduler", "block_manager", "runner", "cache", "model", "executor",
             "model_config", "cache_config", "scheduler_config", "requests", "output_processor"}
    for names in ALLOWED.values():
        assert not names & never and not any(n.startswith("_") for n in names)
    # The checks are the input processor's, not the engine's.
    assert not any(n.startswith("validate_") or n == "compile_grammar" for n in ALLOWED["engine"])


def test_engine_stats_carry_the_gauges_the_metrics_read():
    fields = [f.name for f in dataclasses.fields(EngineStats)]
    assert fields[:12] == ["total_blocks", "used_blocks", "peak_used_blocks", "num_preemptions",
                           "num_swapped_out_blocks", "num_swapped_in_blocks", "num_cow_copies",
                           "prefix_cache_queries", "prefix_cache_hit_tokens",
                           "num_prompt_tokens", "num_generated_tokens", "num_steps"]
    assert {"num_waiting", "num_running", "num_swapped", "total_cpu_blocks",
            "used_cpu_blocks"} <= set(fields)


# -- self-checks: what the walk must report, and what it must let through ------------------

@pytest.mark.parametrize("planted, attribute", [
    ("state.core.tokenizer.decode(x)", "engine.tokenizer"),
    ("engine.scheduler.running", "engine.scheduler"),
    ("len(self.engine.scheduler.waiting)", "engine.scheduler"),
    ("getattr(self.engine.block_manager, 'cpu_pool', None)", "engine.block_manager"),
    ("getattr(engine, 'block_manager')", "engine.block_manager"),
    ("hasattr(state.core, 'runner')", "engine.runner"),
    ("state.core.validate_prompt(p, None)", "engine.validate_prompt"),
    ("core.validate_params(p)", "engine.validate_params"),
    ("state.engine.engine.validate_priority(0)", "engine.validate_priority"),
    ("core.compile_grammar(p)", "engine.compile_grammar"),
    ("engine.cache.copy([])", "engine.cache"),
    ("engine.model(x)", "engine.model"),
    ("async_engine.engine.runner", "engine.runner"),
    ("state.core.model_config.max_model_len", "engine.model_config"),
    ("dataclasses.asdict(self.engine.cache_config)", "engine.cache_config"),
    ("core.scheduler_config.max_num_seqs", "engine.scheduler_config"),
    ("engine._grammars", "engine._grammars"),
    ("state.engine._queues", "engine._queues"),
    ("app.state.engine._step_lock", "engine._step_lock"),
    ("engine.requests", "engine.requests"),
    ("engine.output_processor.eos_token_id", "engine.output_processor"),
    ("state.input_processor.tokenizer", "input_processor.tokenizer"),
    ("state.engine.input_processor._grammars", "input_processor._grammars"),
    ("self.engine.stats.scheduler", "stats.scheduler"),
    ("stats.not_a_field", "stats.not_a_field"),
    ("LLMEngine._build", "engine._build"),
])
def test_the_walk_reports(planted, attribute):
    found = violations(planted)
    assert len(found) == 1 and found[0].endswith(f"({attribute})"), found


def test_the_walk_follows_names_and_annotations():
    source = '''
ip = state.input_processor
ip.tokenizer
def handler(eng: "LLMEngine", inputs: InputProcessor, s: EngineStats | None):
    eng.scheduler
    inputs.tokenizer
    s.block_manager
    core = eng
    core.runner
with make() as nothing_of_the_engine:
    nothing_of_the_engine.scheduler
'''
    found = violations(source)
    assert [v.rpartition("(")[2] for v in found] == [
        "input_processor.tokenizer)", "engine.scheduler)", "input_processor.tokenizer)",
        "stats.block_manager)", "engine.runner)"], found


def test_the_walk_lets_the_public_side_through():
    source = '''
state.engine.generate(None, params, "r", prompt_token_ids=ids)
state.engine.is_running
state.input_processor.validate_prompt(p, None)
state.input_processor.max_model_len
engine.stats.used_blocks
stats = self.engine.stats
stats.num_running + stats.total_cpu_blocks
engine.engine.step_hooks.append(hook)
LLMEngine.from_engine_args(model, args)
engine.has_request("r")
state.served_model_name
scheduler_output.groups
'''
    assert violations(source) == []
