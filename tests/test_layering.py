"""The product never reaches into the kernel lab (``schedules/lab/``), which import-linter cannot
see (the lab is not a package): no module of ``dsv2_mlc/``, ``passes/`` or the shipped
``schedules/`` imports from it, names it in an import path, or puts it on ``sys.path``; and the
installed packages do not include it."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = [ROOT / "dsv2_mlc", ROOT / "passes", ROOT / "schedules"]
LAB = ROOT / "schedules" / "lab"
LAB_MODULES = {p.stem for p in LAB.glob("*.py")}


def _product_files() -> list[Path]:
    return [
        f for folder in PRODUCT for f in folder.rglob("*.py") if LAB not in f.parents and f != LAB
    ]


def _lab_references(path: Path) -> list[tuple[int, str]]:
    """(line, what) of each import of a lab module and each string that points into
    schedules/lab, in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if "lab" in node.value else []
            if any(("schedules/lab" in n or "schedules.lab" in n) and "\n" not in n for n in names):
                found.append((node.lineno, repr(node.value)))
            continue
        else:
            continue
        for name in names:
            parts = name.split(".")
            if "lab" in parts or any(p in LAB_MODULES for p in parts):
                found.append((node.lineno, f"import {name}"))
    return found


def test_the_product_imports_nothing_of_the_lab() -> None:
    files = _product_files()
    assert len(files) > 50  # the scan sees the product
    found = [f"{f.relative_to(ROOT)}:{n}: {what}" for f in files for n, what in _lab_references(f)]
    assert not found, "the product reaches into schedules/lab:\n" + "\n".join(found)


def test_the_scan_finds_a_lab_import(tmp_path: Path) -> None:
    """Negative control: the scan reports an import of a lab module and a path into the lab."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        f"from dsv2_mlc.schedules.lab import {sorted(LAB_MODULES)[0]}\n"
        "import sys\nsys.path.insert(0, 'schedules/lab')\n"
    )
    assert {line for line, _ in _lab_references(bad)} == {1, 3}


def test_the_lab_is_not_installed() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not any("lab" in p.split(".") for p in setup["packages"])
    assert not (LAB / "__init__.py").exists()
