"""The package's imports flow one way, from the model to the doors, and nothing imports in a circle.

Read from the source (``ast``), function bodies included: an import hidden in a function to dodge a
circle is still a circle. Each top-level module or folder has a stage; a module may import its own
stage or an earlier one, never a later one.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmnpu_delegate"

# Stage of each top-level module or folder, in the order data flows. The base (errors .. format) is
# what every stage may use: the kernels, the platform SDK, the shipped text, the program format.
STAGES = {
    "errors": 0, "logs": 0, "paths": 1,
    "fanout": 1,                                   # independent jobs here or as Ray tasks: any stage's sweeps
    "kernels": 2, "qnn": 2, "text": 2,
    "format": 3,                                   # the program format: lower/ writes it, runtime/ reads it
    "families": 4, "models": 4, "chunk_step": 4,   # the model, and its chunk step captured by torch.export
    "quantize": 5,
    "partitioner": 6,
    "prepare": 7,                                  # calibration, plan and partitioned step of one model
    "backends": 8, "lower": 8,                     # an NPU backend lowers a region; lower/ exports a program
    "runtime": 9,                                  # schedules, executor, the chunk runner and its two builders
    "compile": 10, "hf": 10, "evaluate": 10, "simulate": 10,
    "generation": 10, "conversation": 10, "measure": 10, "host_report": 10,
    "harness": 10,                                 # lm-eval's model over evaluate and hf
    "placed_numerics": 10,                         # a placement's attention on the HF model, for evaluate and harness
    "recipes": 10,                                 # ExecuTorch's Qualcomm quantization, a peer to score
    "cli": 11,                                     # the doors, and the CLI over them
    "__init__": 4,                                 # the package itself: its version, errors, load_model
    "capture": 4, "prefill": 9,                    # deprecated re-exports of chunk_step and runtime.engine
}


def _modules() -> dict[str, Path]:
    """Module name -> file; a package's ``__init__.py`` under the package's own name."""
    names = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return names


def _imports(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported module of this package, line, inside a function) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = ".".join(package[:len(package) - child.level + 1]) if child.level else ""
                module = ".".join(x for x in (base, child.module or "") if x)
                # ``from .format import kv`` imports a module, ``from .quantize import QuantConfig`` a name:
                # ``_owner`` reduces either to the module that holds it
                targets = [f"{module}.{a.name}" for a in child.names]
            found.extend((t, child.lineno, in_function) for t in targets if t.split(".")[0] == PACKAGE.name)
            visit(child, inner)

    visit(tree, False)
    return found


def _owner(target: str, modules) -> str:
    """The module an import names: ``pkg.mod.Name`` -> ``pkg.mod``; a name of the package -> its ``__init__``."""
    while target not in modules and "." in target:
        target = target.rpartition(".")[0]
    return target if target in modules else PACKAGE.name


def _stage(module: str) -> int:
    parts = module.split(".")
    return STAGES[parts[1] if len(parts) > 1 else "__init__"]


def test_every_module_has_a_stage():
    assert [m for m in _modules() if (m.split(".")[1] if "." in m else "__init__") not in STAGES] == []


def test_no_module_imports_a_later_stage():
    modules = _modules()
    upward = [f"{name}:{line} imports {target}"
              for name, path in modules.items() for target, line, _ in _imports(name, path)
              if _stage(_owner(target, modules)) > _stage(name)]
    assert upward == []


def test_no_module_imports_in_a_circle():
    modules = _modules()
    # a package's __init__ only gathers names of its own modules: edges through it are not circles
    graph = {name: {o for t, _, _ in _imports(name, path) if (o := _owner(t, modules)) != name
                    and modules[o].name != "__init__.py"} for name, path in modules.items()}
    state: dict[str, int] = {}
    cycles = []

    def walk(node: str, trail: list[str]):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(trail[trail.index(dep):] + [dep]) if dep in trail else dep)
            elif dep not in state:
                walk(dep, trail + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert cycles == []


def test_the_checker_sees_an_upward_import_inside_a_function(tmp_path):
    """The rule must catch the form it forbids: a later stage imported in a function body."""
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from ..runtime.executor import Executor\n    return Executor\n")
    (target, line, inner), = _imports("llmnpu_delegate.lower.mod", src)
    owner = _owner(target, _modules())
    assert (owner, line, inner) == ("llmnpu_delegate.runtime.executor", 2, True)
    assert _stage(owner) > _stage("llmnpu_delegate.lower.mod")
