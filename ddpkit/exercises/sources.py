"""The learner's code as text: from a notebook file (the cells between ``### begin`` and ``### end``, or the
cells that define the contract's names), or back from the objects a check cell was given.

A check cell passes objects (``check_ring_all_reduce(ring_all_reduce)``); the grader runs code, in
another process. IPython keeps every executed cell's text in ``linecache`` under the cell's own file
name, so an object defined in a cell leads back to the whole cell, and the names that cell uses lead to
the cells that define them. An object defined in an importable module is passed by reference instead.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import linecache
import sys
from typing import Any

BEGIN, END = "### begin", "### end"


def marked_cells(nb) -> list[str]:
    """The text between the markers of every code cell that has them, in notebook order."""
    found = []
    for cell in nb.cells:
        if cell.cell_type != "code" or BEGIN not in cell.source:
            continue
        lines, inside, kept = cell.source.splitlines(), False, []
        for line in lines:
            if line.strip() == BEGIN:
                inside = True
            elif line.strip() == END:
                inside = False
            elif inside:
                kept.append(line)
        found.append("\n".join(kept))
    return found


def defining_cells(nb, names: tuple[str, ...]) -> list[str]:
    """Code cells that define any of ``names`` (a def, a class or an assignment), when the markers are gone."""
    found = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(_without_magics(cell.source))
        except SyntaxError:
            continue
        if defined_names(tree) & set(names):
            found.append(_without_magics(cell.source))
    return found


def defined_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _without_magics(source: str) -> str:
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def learner_code(nb, names: tuple[str, ...]) -> str:
    """All the learner's code for a notebook: the marked cells, else the cells defining the contract's names."""
    cells = marked_cells(nb) or defining_cells(nb, names)
    return "\n\n".join(_without_magics(c) for c in cells)


def normalised(code: str) -> str | None:
    """The code's structure without comments, docstrings or string-only statements, and with every name the
    code binds itself (its variables, arguments, functions, classes and import aliases) replaced by its
    order of first appearance: renaming a variable does not change it, while names it only uses (builtins,
    attributes, a module's members) are kept. None if the code does not parse."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                                                  and isinstance(n.value.value, str))] or [ast.Pass()]
    canonical: dict[str, str] = {}
    for name in _bound_names(tree):
        canonical.setdefault(name, f"_{len(canonical)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            node.id = canonical.get(node.id, node.id)
        elif isinstance(node, ast.arg):
            node.arg = canonical.get(node.arg, node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            node.name = canonical.get(node.name, node.name)
        elif isinstance(node, ast.alias):
            bound = node.asname or node.name.split(".")[0]
            node.asname = canonical.get(bound, node.asname)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            node.names = [canonical.get(n, n) for n in node.names]
        elif isinstance(node, ast.ExceptHandler) and node.name:
            node.name = canonical.get(node.name, node.name)
    return ast.dump(tree, annotate_fields=False)


def _bound_names(tree: ast.AST) -> list[str]:
    """The names ``tree`` binds, in the order :func:`ast.walk` first meets them."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            found.append(node.id)
        elif isinstance(node, ast.arg):
            found.append(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append(node.name)
        elif isinstance(node, ast.alias) and node.name != "*":
            found.append(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            found.append(node.name)
    return found


# ------------------------------------------------------------------- objects back to code (check cells)


def _code_file(obj: Any) -> str | None:
    obj = getattr(obj, "func", obj)  # functools.partial
    obj = getattr(obj, "__func__", obj)
    if inspect.isfunction(obj):
        return obj.__code__.co_filename
    if inspect.isclass(obj):
        for value in vars(obj).values():
            value = getattr(value, "__func__", value)
            if inspect.isfunction(value):
                return value.__code__.co_filename
    return None


def _module_ref(obj: Any) -> str | None:
    """``module:name`` when ``obj`` is a global of an importable module other than ``__main__``."""
    first = sys.modules.get(getattr(obj, "__module__", None) or "")
    for module in [first, *list(sys.modules.values())]:
        if module is None or getattr(module, "__name__", "__main__") == "__main__" or not getattr(module, "__file__", None):
            continue
        for name, value in list(vars(module).items()):
            if value is obj:
                return f"{module.__name__}:{name}"
    return None


def code_of(objects: tuple, names: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """(the code of the cells that define ``objects`` and what they use, references to importable ones),
    with each contract name bound to the object passed in its place."""
    cells: list[str] = []
    seen_files: set[str] = set()
    refs: dict[str, str] = {}
    aliases: list[str] = []
    for name, obj in zip(names, objects):
        filename = _code_file(obj)
        if filename and linecache.getlines(filename) and not _is_module_file(filename):
            _collect_cell(filename, cells, seen_files)
            own = getattr(getattr(obj, "func", obj), "__name__", name)
            if own != name:
                aliases.append(f"{name} = {own}")
            continue
        ref = _module_ref(obj)
        if ref is None:
            raise ValueError(f"cannot find the code of {getattr(obj, '__name__', obj)!r}: define it in a cell of this "
                             f"notebook (or in an importable module)")
        refs[name] = ref
    return "\n\n".join(cells + aliases), refs


def _is_module_file(filename: str) -> bool:
    return filename.endswith(".py") and any(getattr(m, "__file__", None) == filename for m in list(sys.modules.values())
                                            if getattr(m, "__name__", "") != "__main__")


def _collect_cell(filename: str, cells: list[str], seen: set[str]) -> None:
    """Add the cell in ``filename``, after the cells that define the globals it uses (depth first)."""
    if filename in seen:
        return
    seen.add(filename)
    source = "".join(linecache.getlines(filename))
    main = sys.modules.get("__main__")
    try:
        used = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
        own = defined_names(ast.parse(source))
    except SyntaxError:
        used, own = set(), set()
    for name in sorted(used - own - set(dir(builtins))):
        value = getattr(main, name, None) if main is not None else None
        other = _code_file(value) if value is not None else None
        if other and other != filename and linecache.getlines(other) and not _is_module_file(other):
            _collect_cell(other, cells, seen)
    cells.append(_without_magics(source))
