"""The layering of docs/ARCHITECTURE.md, held against the code's own imports on every test run.

Read from the source with `ast` (nothing is imported): every import of a shardwise module, at the
top of a module or inside a function, is an edge. The rules: the edges form no cycle; a module
imports only from lower layers, or from its own package; no module imports another's `_private`
name; imports sit at the top of modules except optional dependencies; and the layer table here is
the one the document shows.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "shardwise"
DOC = ROOT / "docs" / "ARCHITECTURE.md"

# Top-level module or package of shardwise -> its layer (docs/ARCHITECTURE.md, "Packages").
LAYERS = {
    "errors": 0, "loss": 0, "files": 0, "untrusted": 0, "units": 0, "torch_support": 0, "html_page": 1,
    "models": 1, "preference": 1,
    "config": 2,
    "data": 3, "peft": 3,
    "hardware": 4, "builder": 4,
    "parallel": 5,
    "memory": 6, "checkpoint": 6,
    "step_time": 7,
    "train": 8,
    "resolve": 9,
    "inference": 10, "export": 10, "plan": 10, "report": 10,
    "api": 11, "cli": 11,
    "__main__": 12, "__init__": 12,
}
# Imported inside functions on purpose: extras a user may not have installed, or device libraries.
OPTIONAL = ("pyarrow", "sentencepiece", "torch.utils.tensorboard", "torch_npu", "transformers", "peft", "torchao",
            "matplotlib", "wandb", "mlflow", "bitsandbytes")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ("shardwise", *path.relative_to(SRC).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, source: str, is_package: bool = False) -> list[tuple[str, list[str], bool, int]]:
    """(imported module, names taken from it, inside a function?, line) for each import of `source`."""
    tree = ast.parse(source)
    top_level = set()
    for node in tree.body:  # what a module does at import time, including inside top-level if/try
        top_level.update(id(n) for n in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)))
    package = name if is_package else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        inside = id(node) not in top_level
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, [], inside, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in MODULES:  # `from .pkg import module`
                    found.append((target, [], inside, node.lineno))
                else:
                    found.append((base, [alias.name], inside, node.lineno))
    return found


def _edges() -> list[tuple[str, str, list[str], bool, int]]:
    edges = []
    for name, path in MODULES.items():
        source = path.read_text(encoding="utf-8")
        for target, names, inside, line in _imports(name, source, path.name == "__init__.py"):
            edges.append((name, target, names, inside, line))
    return edges


EDGES = _edges()


def _internal(target: str) -> str | None:
    """The shardwise module an import names (the deepest one that exists), else None."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target if target.startswith("shardwise") else None


def _top(module: str) -> str:
    """The top-level module or package of shardwise a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(ROOT)}:{line}"


def test_every_module_has_a_layer() -> None:
    missing = sorted({_top(m) for m in MODULES} - set(LAYERS))
    assert not missing, f"modules without a layer in LAYERS and docs/ARCHITECTURE.md: {missing}"


def test_the_document_shows_the_same_layers() -> None:
    text = DOC.read_text(encoding="utf-8")
    shown: dict[str, int] = {}
    for layer, cell in re.findall(r"^\| (\d+) \| ([^|]+) \|", text, flags=re.M):
        for module in re.findall(r"`([\w]+)(?:\.py|/)?`", cell):
            shown[module] = int(layer)
    expected = dict(LAYERS)
    assert shown == expected, f"docs/ARCHITECTURE.md shows {shown}, the test holds {expected}"


def test_no_module_imports_from_a_higher_layer() -> None:
    wrong = []
    for name, target, _, _, line in EDGES:
        target = _internal(target)
        if target is None or target == name:
            continue
        mine, theirs = _top(name), _top(target)
        if mine == theirs:
            continue  # inside one package any order goes, as long as there is no cycle
        if theirs == "errors" and mine != "errors":
            continue  # layer 0 may import the error types (the table's "nothing of shardwise but errors")
        if LAYERS[theirs] >= LAYERS[mine]:
            wrong.append(f"{_where(name, line)} ({mine}, layer {LAYERS[mine]}) imports {target} "
                         f"({theirs}, layer {LAYERS[theirs]})")
    assert not wrong, "imports that run up or sideways:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, target, _, _, _ in EDGES:
        target = _internal(target)
        if target is not None and target != name:
            graph[name].add(target)
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_takes_another_modules_private_names() -> None:
    wrong = [f"{_where(name, line)} imports {n} from {target}" for name, target, names, _, line in EDGES
             for n in names if n.startswith("_") and not n.startswith("__") and _internal(target) is not None]
    assert not wrong, "\n".join(wrong)


def test_imports_sit_at_the_top_of_modules() -> None:
    wrong = [f"{_where(name, line)} imports {target} inside a function" for name, target, _, inside, line in EDGES
             if inside and not target.startswith(OPTIONAL)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("bad, rule", [
    ("from ..train.trainer import Trainer\n", test_no_module_imports_from_a_higher_layer),
    ("def f():\n    from ..config import RunConfig\n", test_imports_sit_at_the_top_of_modules),
    ("from ..config.schema import _check_numbers\n", test_no_module_takes_another_modules_private_names),
    ("from .transformer import Transformer\n", test_no_import_cycle),
], ids=["upward", "inside a function", "private", "cycle"])
def test_the_rules_catch_a_broken_module(bad: str, rule, monkeypatch) -> None:  # noqa: ANN001
    """A models module that imports wrongly fails each rule (the checks can fail)."""
    name = "shardwise.models.broken"
    monkeypatch.setitem(MODULES, name, SRC / "models" / "broken.py")
    edges = [(name, target, names, inside, line) for target, names, inside, line in _imports(name, bad)]
    if rule is test_no_import_cycle:  # and a module it imports imports it back
        edges.append(("shardwise.models.transformer", name, ["x"], False, 1))
    monkeypatch.setattr(sys.modules[__name__], "EDGES", EDGES + edges)
    with pytest.raises(AssertionError):
        rule()
