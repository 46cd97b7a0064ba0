"""The package's layers: every import between rlsearch's folders (lazy and TYPE_CHECKING ones too) runs down, and no
module takes part in an import circle. The floors, bottom to top, are those of docs/architecture.md."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rlsearch"

# each room is a top-level module or folder of rlsearch ("rlsearch" is the package's own __init__)
FLOORS: list[set[str]] = [
    {"rlsearch", "trajectory", "algo", "devices", "failover", "files", "lifetime", "loop_thread", "rendezvous",
     "runlog"},
    {"config", "ray_setup"},
    {"megatron", "memory"},
    {"weights", "tools", "checkpoint"},
    {"actor", "rollout", "data"},
    {"reward"},
    {"eval", "inspection", "doctor", "supervisor"},
    {"trainer"},
    {"cli"},
    {"__main__"},
]
FLOOR_OF = {room: index for index, rooms in enumerate(FLOORS) for room in rooms}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _existing_module(dotted: str) -> str:
    """The module that `import dotted` (or `from dotted import name`) loads: a name imported from a package is an
    attribute of its __init__ unless it is a submodule."""
    while dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """(imported rlsearch module, line) of every import statement in `module`, wherever it sits."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "rlsearch" or target.startswith("rlsearch."):
                yield _existing_module(target), node.lineno


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rlsearch"


def test_every_room_has_a_floor() -> None:
    rooms = {_room(module) for module in MODULES}
    assert rooms - FLOOR_OF.keys() == set(), "a new top-level module or folder: give it a floor in FLOORS"
    assert FLOOR_OF.keys() - rooms == set(), "FLOORS names a room that no longer exists"


def test_imports_run_down_only() -> None:
    upward = []
    for module in sorted(MODULES):
        for target, line in _imports(module):
            source_room, target_room = _room(module), _room(target)
            if source_room != target_room and FLOOR_OF[target_room] >= FLOOR_OF[source_room]:
                upward.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target} "
                              f"(floor {FLOOR_OF[target_room]} from floor {FLOOR_OF[source_room]})")
    assert upward == []


def test_no_import_circle() -> None:
    graph = {module: {target for target, _ in _imports(module) if target != module} for module in MODULES}
    circles = []
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    assert circles == []


def test_the_walk_sees_lazy_and_type_only_imports(tmp_path) -> None:
    """The walk is the test's only instrument: it must see imports inside functions and under TYPE_CHECKING."""
    imported = {target for target, _ in _imports("rlsearch.checkpoint.convert")}
    assert "rlsearch.megatron.model" in imported  # imported inside functions only
    imported = {target for target, _ in _imports("rlsearch.reward.score")}
    assert "rlsearch.trajectory" in imported  # under TYPE_CHECKING only


TRAINER = "rlsearch.trainer"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(module: str, source: str) -> list[str]:
    """Where `module` (a module of rlsearch/trainer/, its text `source`) uses a private name of another trainer
    module: one it imports (`from .grpo import _timed`), or an attribute of a trainer module it imported
    (`from . import startup` ... `startup._foo`)."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found, imported = [], {}  # imported: local name -> the trainer module it stands for
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in MODULES and target.startswith(f"{TRAINER}."):  # a module: `from . import startup`
                    imported[alias.asname or alias.name] = target
                elif base.startswith(TRAINER) and base != module and _is_private(alias.name):
                    found.append(f"line {node.lineno}: from {base} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(f"{TRAINER}."):  # used as the alias, or by its dotted name
                    imported[alias.asname or alias.name] = alias.name
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = imported.get(ast.unparse(node.value), module)
            if owner != module:
                found.append(f"line {node.lineno}: {owner}.{node.attr}")
    return found


def test_trainer_modules_use_no_private_name_of_another() -> None:
    """A helper that several trainer modules share is public (trainer/timing.py's `timed`): one module's private
    names are its own, free to change without reading the others."""
    uses = [f"{MODULES[module].relative_to(PACKAGE.parent)} {use}"
            for module in sorted(MODULES) if module.startswith(f"{TRAINER}.")
            for use in _private_uses(module, MODULES[module].read_text())]
    assert uses == []


def test_the_private_name_check_sees_imports_and_attributes() -> None:
    """The check's instrument: a private import, and a private attribute of an imported module, are found."""
    source = ("from .grpo import GRPOTrainer, _timed\nfrom . import startup as boot\nimport rlsearch.trainer.recovery\n"
              "boot._token_logit_bias(None)\nboot.start_run(None)\nself._own()\n"
              "rlsearch.trainer.recovery._limit\nrlsearch.trainer.recovery.RestartPolicy\n")
    assert sorted(_private_uses("rlsearch.trainer.checkpoints", source)) == [
        "line 1: from rlsearch.trainer.grpo import _timed", "line 4: rlsearch.trainer.startup._token_logit_bias",
        "line 7: rlsearch.trainer.recovery._limit"]
