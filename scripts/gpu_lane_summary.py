"""docs/gpu-tests.md from the GPU lane's JUnit XML (``pytest -m gpu tests/gpu --junitxml ...``).

``python scripts/gpu_lane_summary.py gpu-lane.xml [--out docs/gpu-tests.md] [--commit SHA]``
writes the commit (``--commit``, else the builds' commit the lane recorded, else this checkout's
HEAD), the run's date, the GPU (recorded by tests/gpu/conftest.py), the pass / fail / error / skip
counts and one line per test: outcome, seconds, and the first line of the message of a failure,
an error or a skip. Exit status 1 when the XML holds a failure or an error.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass(frozen=True)
class Case:
    """One test case of the XML."""

    name: str  # file.py::test[params]
    outcome: str  # one of OUTCOMES
    seconds: float
    message: str  # first line of the failure / error / skip message ("" when it passed)


@dataclass(frozen=True)
class Run:
    """The lane's run: its suite properties, date, time and cases."""

    properties: dict[str, str]
    timestamp: str
    hostname: str
    seconds: float
    cases: list[Case]

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.cases)


def _case(el: ET.Element) -> Case:
    module = el.get("classname", "").rsplit(".", 1)[-1]
    name = f"{module}.py::{el.get('name', '?')}" if module else el.get("name", "?")
    outcome, message = "passed", ""
    for tag, kind in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        found = el.find(tag)
        if found is not None:
            outcome = kind
            text = found.get("message") or (found.text or "")
            message = next((line.strip() for line in text.splitlines() if line.strip()), "")
            break
    return Case(name, outcome, float(el.get("time") or 0.0), message)


def read_junit(path: str | Path) -> Run:
    """The run of a pytest JUnit XML (one ``testsuite``, under ``testsuites`` or not)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise ValueError(f"{path}: no <testsuite>")
    props: dict[str, str] = {}
    cases: list[Case] = []
    for suite in suites:
        for prop in suite.iter("property"):
            props[prop.get("name", "")] = prop.get("value", "")
        cases.extend(_case(el) for el in suite.iter("testcase"))
    first = suites[0]
    seconds = sum(float(s.get("time") or 0.0) for s in suites)
    return Run(props, first.get("timestamp", ""), first.get("hostname", ""), seconds, cases)


def _head() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    return out.stdout.strip() or "unknown"


def _cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render(run: Run, commit: str) -> str:
    """The markdown page of ``run``."""
    p = run.properties
    gpu = p.get("gpu", "unknown")
    if p.get("cuda_driver_api"):
        gpu += f" (driver CUDA {p['cuda_driver_api']})"
    counts = ", ".join(f"{run.count(o)} {o}" for o in OUTCOMES)
    lines = [
        "# GPU tests (tests/gpu)",
        "",
        "The last run of the GPU lane (`pytest -m gpu tests/gpu`, see tests/gpu/README.md), "
        "written by",
        "`scripts/gpu_lane_summary.py` from its JUnit XML.",
        "",
        "| | |",
        "| --- | --- |",
        f"| commit | `{commit}` |",
        f"| date | {run.timestamp or 'unknown'} |",
        f"| GPU | {_cell(gpu)} |",
        f"| result | {counts} of {len(run.cases)} tests, {run.seconds:.0f} s |",
        "",
        "| test | outcome | seconds | message |",
        "| --- | --- | ---: | --- |",
    ]
    for c in run.cases:
        lines.append(f"| `{c.name}` | {c.outcome} | {c.seconds:.1f} | {_cell(c.message)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", help="the lane's JUnit XML")
    p.add_argument("--out", default=str(ROOT / "docs" / "gpu-tests.md"))
    p.add_argument("--commit", default=None, help="default: the builds' commit, else HEAD")
    args = p.parse_args(argv)
    run = read_junit(args.junit)
    commit = args.commit or run.properties.get("builds_commit") or _head()
    Path(args.out).write_text(render(run, commit))
    print(f"wrote {args.out}: " + ", ".join(f"{run.count(o)} {o}" for o in OUTCOMES))
    return 1 if run.count("failed") or run.count("error") else 0


if __name__ == "__main__":
    sys.exit(main())
