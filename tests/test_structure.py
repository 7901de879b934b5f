"""The import structure stays as docs/architecture.md draws it.

``lint-imports`` (run by ``make test``) checks the contracts in pyproject.toml;
these tests check what the contracts cannot say by themselves.
"""
from __future__ import annotations

import ast
import pkgutil
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("packrat_mq", "dispatcher", "workers", "optimizer")


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _modules(package: str) -> list[str]:
    pkg = __import__(package)
    return sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."))


def test_every_core_module_is_under_the_core_contract() -> None:
    """A new module of packrat_mq is core unless it is shell or zoo, and the contract must name it."""
    core = next(c for c in _contracts() if c["name"].startswith("The core"))
    listed = set(core["source_modules"])
    outside = ("packrat_mq.cli", "packrat_mq.zoo", "packrat_mq.__main__")
    modules = {m for m in _modules("packrat_mq") if not any(m == o or m.startswith(o + ".") for o in outside)}
    assert modules - listed == set(), "add these core modules to the core contract in pyproject.toml"
    assert listed - modules == set(), "the core contract names modules that do not exist"


def _python_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]


def test_no_module_edits_the_import_path() -> None:
    pattern = re.compile(r"sys\.path\s*[.\[=]|[\"']PYTHONPATH[\"']")
    offenders = [str(p.relative_to(ROOT)) for p in _python_files() if pattern.search(p.read_text())]
    assert offenders == []


def test_one_place_pins_cpus_and_one_configures_logging() -> None:
    def calls(name: str) -> list[str]:
        found = []
        for p in _python_files():
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name:
                    found.append(str(p.relative_to(ROOT)))
        return found

    assert calls("sched_setaffinity") == ["workers/runtime.py"]
    assert calls("basicConfig") == ["packrat_mq/logs.py"]


def test_project_imports_are_at_module_level_outside_the_shell() -> None:
    """Imports inside functions hid cycles; below the shell, every project import is at the top.

    The shell (packrat_mq.cli) may defer imports to keep ``--help`` fast.
    """
    hidden = []
    for p in _python_files():
        rel = p.relative_to(ROOT)
        if rel.parts[:2] == ("packrat_mq", "cli"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and inner.module and inner.module.split(".")[0] in PACKAGES:
                        hidden.append(f"{rel}:{inner.lineno} {inner.module}")
                    elif isinstance(inner, ast.Import) and any(a.name.split(".")[0] in PACKAGES for a in inner.names):
                        hidden.append(f"{rel}:{inner.lineno}")
    assert hidden == []
