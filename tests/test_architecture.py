"""The package's shape, read from its source: layers import only downwards, no import cycle,
no module reaches into another's private names, every collective goes through
zerodp.distributed, files stay small, and the engine does not pull in the demo."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "zerodp"

# Bottom to top; a module may import from its own layer or a lower one. Data flows one way:
# config -> topology (distributed) -> layout (memory) -> sharding -> schedule -> optimizer,
# and every layer moves bytes through distributed's collectives.
LAYERS = [
    ("zerodp.version", "zerodp.policies", "zerodp.config", "zerodp.config_world", "zerodp.config_values",
     "zerodp.deepspeed_config"),
    ("zerodp.distributed",),
    ("zerodp.memory",),
    ("zerodp.sharding", "zerodp.tensor_parallel", "zerodp.expert_parallel"),
    ("zerodp.schedule",),
    ("zerodp.optim",),
    ("zerodp.checkpoint",),
    ("zerodp.api", "zerodp"),
    ("zerodp.integrations",),
    ("zerodp.demo",),
    ("zerodp.cli", "zerodp.__main__"),
]

# torch.distributed calls that communicate; only zerodp.distributed may make them.
COLLECTIVES = {"new_group", "new_subgroups", "init_device_mesh", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
               "send", "recv", "isend", "irecv", "reduce", "gather", "scatter", "broadcast_object_list"}

MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def resolve(importer: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(name: str) -> list[tuple[str, str, int]]:
    """(imported zerodp module, the name taken from it or "", line) for every import in
    `name`, at any depth (imports inside functions count too)."""
    out = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "zerodp"]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, node)
            if target.split(".")[0] != "zerodp":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:  # `from . import hostmem`: the submodule itself
                    out.append((sub, "", node.lineno))
                else:
                    out.append((target, a.name, node.lineno))
    return out


def layer_of(name: str) -> int:
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_layers_import_only_downwards():
    wrong = []
    for name in MODULES:
        for target, _, line in imports(name):
            if layer_of(target) > layer_of(name):
                wrong.append(f"{name}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {name: {t for t, _, _ in imports(name) if t in MODULES and t != name} for name in MODULES}
    # A package's __init__ re-exports its submodules; importing a submodule runs the
    # package's __init__ first, so an edge into `a.b.c` is also an edge into `a.b`.
    for name in list(graph):
        for t in list(graph[name]):
            parts = t.split(".")
            for k in range(1, len(parts)):
                parent = ".".join(parts[:k])
                if parent in MODULES and not name.startswith(parent + ".") and name != parent:
                    graph[name].add(parent)
    state: dict = {}
    cycles = []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def private_definitions(tree: ast.Module) -> set:
    """Private names a module defines: functions, classes, module globals and attributes
    it assigns on self."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_uses_another_modules_private_names():
    defined = {name: private_definitions(tree) for name, tree in TREES.items()}
    wrong = []
    for name, tree in TREES.items():
        for target, taken, line in imports(name):
            if taken.startswith("_") and not taken.startswith("__"):
                wrong.append(f"{name}:{line} imports {taken} from {target}")
        elsewhere = set().union(*(d for n, d in defined.items() if n != name)) - defined[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in elsewhere:
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                wrong.append(f"{name}:{node.lineno} uses .{node.attr}, private to another module")
    assert not wrong, "\n".join(wrong)


def test_collectives_only_in_distributed():
    wrong = []
    for name, tree in TREES.items():
        if name.startswith("zerodp.distributed"):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("dist", "distributed")):
                wrong.append(f"{name}:{node.lineno} calls torch.distributed.{node.func.attr}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_stay_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines; split it by responsibility"


def test_the_engine_does_not_import_the_demo_or_plotting():
    code = ("import sys, zerodp; bad = [m for m in sys.modules if m.startswith(('zerodp.demo', 'zerodp.cli', "
            "'matplotlib'))]; print(bad); raise SystemExit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_architecture_test_sees_violations(tmp_path):
    """The checks above are not vacuous: a module importing upwards, a cycle and a private
    name are each found."""
    up = ast.parse("from ..api import initialize\nfrom ..optim.optimizer import _secret\n")
    TREES["zerodp.memory.fake"], MODULES["zerodp.memory.fake"] = up, tmp_path / "fake.py"
    try:
        found = imports("zerodp.memory.fake")
        assert ("zerodp.api", "initialize", 1) in found
        assert layer_of("zerodp.api") > layer_of("zerodp.memory.fake")
        with pytest.raises(AssertionError, match="imports _secret"):
            test_no_module_uses_another_modules_private_names()
    finally:
        del TREES["zerodp.memory.fake"], MODULES["zerodp.memory.fake"]


def _calls_and_keywords(tree: ast.Module):
    """(attribute or function name called, keyword names) of every call in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            yield name, {k.arg for k in node.keywords}, node.lineno


def test_one_reduce_queue():
    """Reductions in flight are waited for in one place, schedule/base.py's ReduceQueue: the
    stage 0-2 reducer and the stage-3 engine only order them, and every storage (a stage
    0-2 bucket, a stage-3 unit) offers the same verbs for its own collectives."""
    wrong = [f"{name}:{line} polls a collective (is_completed)" for name, tree in TREES.items()
             if name not in ("zerodp.schedule.base", "zerodp.distributed.collectives")
             for called, _, line in _calls_and_keywords(tree) if called == "is_completed"]
    assert not wrong, "\n".join(wrong)
    queue_users = [name for name in ("zerodp.schedule.reducer", "zerodp.schedule.stage3")
                   if any(called == "ReduceQueue" for called, _, _ in _calls_and_keywords(TREES[name]))]
    assert queue_users == ["zerodp.schedule.reducer", "zerodp.schedule.stage3"], queue_users
    verbs = {"launch_reduce", "reduced_chunk", "finish_reduce"}
    for name, cls in (("zerodp.sharding.bucket", "Bucket"), ("zerodp.sharding.flat_unit", "FlatUnit")):
        node = next(n for n in ast.walk(TREES[name]) if isinstance(n, ast.ClassDef) and n.name == cls)
        methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        assert verbs <= methods, f"{cls} lacks {sorted(verbs - methods)}"


def test_only_the_placement_module_allocates_offloaded_storage():
    """Pinned host memory and offload files are allocated by memory/placement.py alone
    ([Note: placement]); diskmem.py is the file layer under it."""
    wrong = []
    for name, tree in TREES.items():
        if name in ("zerodp.memory.placement", "zerodp.memory.diskmem"):
            continue
        for called, keywords, line in _calls_and_keywords(tree):
            if "pin_memory" in keywords or called in ("OffloadDir", "Arena", "arena"):
                wrong.append(f"{name}:{line} allocates offloaded storage ({called})")
    assert not wrong, "\n".join(wrong)


def test_config_refusals_live_with_the_config():
    """A Config that cannot take effect is refused where it is built (config.py) or, where the
    world decides, by config_world.check_world: nothing below the face re-checks a field
    combination on its own (ConfigErrors elsewhere concern a model or a trainer, not fields)."""
    allowed = {"zerodp.config", "zerodp.config_values", "zerodp.config_world", "zerodp.deepspeed_config", "zerodp.deepspeed_config.zero",
               "zerodp.deepspeed_config.optim", "zerodp.distributed.topology", "zerodp.tensor_parallel.plan", "zerodp.expert_parallel.plan",
               "zerodp.sequence_parallel.inputs", "zerodp.sequence_parallel.tiled_loss", "zerodp.sequence_parallel.tiled_mlp",
               "zerodp.tensor_parallel.activations", "zerodp.integrations.hf", "zerodp.integrations.accelerate", "zerodp.demo.train"}
    raising = {name for name, tree in TREES.items()
               for called, _, _ in _calls_and_keywords(tree) if called == "ConfigError"}
    assert raising <= allowed, sorted(raising - allowed)
    # world-dependent checks are called once, from initialize
    assert any(called == "check_world" for called, _, _ in _calls_and_keywords(TREES["zerodp.api"]))
