"""The package's layering: what the trainer imports never imports the trainer back.

A module that ``train.py`` depends on (directly or through others) and that imports ``ddpkit.train``,
even inside a function, closes an import circle: it works only because of the order in which modules
happen to load, and a reader cannot tell which module is below which. The graph is read from the source
(every ``import``, at any depth, except under ``if TYPE_CHECKING:``), so the check needs no import.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ddpkit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):  # imports needed only by type checkers run nothing
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in known}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(paths)) for name, path in paths.items()}


def _below(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    return seen


def test_nothing_the_trainer_imports_imports_the_trainer():
    graph = import_graph()
    circle = sorted(name for name in _below(graph, "ddpkit.train") if "ddpkit.train" in graph[name])
    assert circle == [], f"imported by ddpkit.train and importing it back: {circle}"


def test_the_check_sees_an_import_inside_a_function():
    """Negative control: the same check on a graph with one import circle (through a function body)."""
    source = "def f():\n    from ddpkit.train import Trainer\n"
    tree_imports = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    graph = import_graph()
    graph["ddpkit.sharded_checkpoint"] |= tree_imports
    assert "ddpkit.sharded_checkpoint" in _below(graph, "ddpkit.train")
    assert any("ddpkit.train" in graph[name] for name in _below(graph, "ddpkit.train"))


def test_metrics_does_not_import_the_runtime_it_sits_below():
    assert "ddpkit.runtime" not in import_graph()["ddpkit.metrics"]
