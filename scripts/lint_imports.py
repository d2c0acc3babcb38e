"""Check the import contracts of ``pyproject.toml`` (``[tool.importlinter]``) as installed.

``passes/`` and ``schedules/`` become ``dsv2_mlc.passes`` and ``dsv2_mlc.schedules`` only through
``[tool.setuptools] package-dir``. import-linter (grimp) finds a package's modules by walking its
folder, so on the source tree or an editable install it sees ``dsv2_mlc/`` without them. This
script lays the listed packages out as setuptools installs them (each package's ``*.py`` files from
its ``package-dir`` folder) in a temporary folder and runs ``lint-imports`` there.

Usage: ``python scripts/lint_imports.py [lint-imports options]``; the exit status is lint-imports'.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def source_dir(package: str, package_dir: dict[str, str]) -> Path:
    """The folder setuptools reads ``package`` from (the longest ``package-dir`` prefix)."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in package_dir:
            return ROOT / package_dir[prefix] / Path(*parts[i:])
    return ROOT / Path(*parts)


def lay_out(dest: Path) -> list[str]:
    """Copy every package of ``[tool.setuptools] packages`` to ``dest`` as it is installed;
    returns the packages."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = setup.get("packages")
    if not isinstance(packages, list):
        raise SystemExit("lint_imports: [tool.setuptools] packages must be an explicit list")
    package_dir = setup.get("package-dir", {})
    for package in packages:
        src = source_dir(package, package_dir)
        if not (src / "__init__.py").is_file():
            raise SystemExit(f"lint_imports: {package}: no {src}/__init__.py")
        out = dest / Path(*package.split("."))
        out.mkdir(parents=True, exist_ok=True)
        for module in src.glob("*.py"):
            shutil.copy2(module, out / module.name)
    return packages


def main(argv: list[str]) -> int:
    """Lay the packages out in a temporary folder and run lint-imports on them."""
    with tempfile.TemporaryDirectory(prefix="dsv2-lint-imports-") as tmp:
        lay_out(Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        # lint-imports puts its working directory first on sys.path: run it in the copy, so the
        # source tree's dsv2_mlc/ (or an editable install) is not the one it finds.
        cmd = [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; "
            "sys.exit(lint_imports_command())",
            str(ROOT / "pyproject.toml"),
            *argv,
        ]
        return subprocess.run(cmd, cwd=tmp, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
