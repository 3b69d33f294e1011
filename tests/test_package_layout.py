"""The package's shape, read from the source with :mod:`ast` (nothing imported): imports go one way
(model/engine uses neither model.training, model.evaluation nor app; model.evaluation never uses
model.training, nor model.training model.evaluation), every exception class is in model/errors.py, and no
Python file of app/ or model/engine/ runs past 400 lines, nor a function past 80."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("model", "app")

# (the files of this subpackage, may not import these modules or anything under them)
FORBIDDEN = [
    ("model.engine", ("model.training", "model.evaluation", "app")),
    ("model.evaluation", ("model.training",)),
    ("model.training", ("model.evaluation",)),
]


def python_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    """``model/engine/decoding.py`` -> ``model.engine.decoding``; ``model/engine/__init__.py`` -> ``model.engine``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` anywhere in ``path`` names (inside functions too),
    relative imports resolved, as (line, absolute dotted name). ``from pkg import name`` counts as
    ``pkg.name`` as well as ``pkg`` (the name may be a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module_name(path)
    # the package a relative import starts from: the module's own package (or itself for __init__.py)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = len(package) - (node.level - 1)
                assert up > 0, f"{path}:{node.lineno}: relative import beyond the top-level package"
                base = ".".join(package[:up] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_relative_imports_resolve():
    assert module_name(ROOT / "model" / "engine" / "decoding.py") == "model.engine.decoding"
    assert module_name(ROOT / "model" / "engine" / "__init__.py") == "model.engine"
    names = {name for _, name in imported_modules(ROOT / "model" / "__init__.py")}
    assert "model.engine.decoding" in names  # `from .engine.decoding import ...` in the package itself


@pytest.mark.parametrize(("package", "forbidden"), FORBIDDEN, ids=[p for p, _ in FORBIDDEN])
def test_imports_go_one_way(package, forbidden):
    files = python_files(package.replace(".", "/"))
    assert files, f"no files under {package}"
    wrong = [f"{path.relative_to(ROOT)}:{line}: imports {name}"
             for path in files for line, name in imported_modules(path)
             if any(_under(name, f) for f in forbidden)]
    assert not wrong, "\n".join(wrong)


def _base_name(node: ast.expr) -> str | None:
    """``ValueError`` -> ``ValueError``; ``errors.CheckpointError`` -> ``CheckpointError``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def test_every_exception_class_is_in_model_errors():
    classes: list[tuple[str, str, list[str]]] = []  # (where, class name, base names)
    for package in PACKAGES:
        for path in python_files(package):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    classes.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.name,
                                    [b for b in map(_base_name, node.bases) if b]))
    exceptions = {name for name in dir(builtins)
                  if isinstance(getattr(builtins, name), type) and issubclass(getattr(builtins, name), BaseException)}
    grew = True
    while grew:  # classes deriving from exception classes, to any depth
        new = {name for _, name, bases in classes if exceptions.intersection(bases)} - exceptions
        exceptions |= new
        grew = bool(new)
    defined = [(where, name) for where, name, bases in classes if exceptions.intersection(bases)]
    assert any(where.startswith("model/errors.py") for where, _ in defined)  # the check sees them
    elsewhere = [f"{where}: {name}" for where, name in defined if not where.startswith("model/errors.py")]
    assert not elsewhere, "exception classes outside model/errors.py:\n" + "\n".join(elsewhere)


#: Most lines of a Python file, and of one function, in the packages that hold the page and the engine.
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 80


@pytest.mark.parametrize("package", ["app", "model/engine"])
def test_files_and_functions_stay_readable(package):
    too_long = []
    for path in python_files(package):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, "split these:\n" + "\n".join(too_long)


def test_kernel_sources_stay_readable():
    """Our C++ pass is one translation unit in parts (mtp_kernels.cpp includes mtp_*.h), each a file of its own size."""
    parts = sorted((ROOT / "model/engine/kernels").glob("*.cpp")) + sorted((ROOT / "model/engine/kernels").glob("*.h"))
    assert len(parts) > 1
    long = [f"{p.name}: {p.read_text().count(chr(10))} lines" for p in parts if p.read_text().count("\n") > MAX_FILE_LINES]
    assert not long, "split these:\n" + "\n".join(long)
