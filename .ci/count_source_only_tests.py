"""Count the collected test cases that only check that something compiled or that strings appear
in generated source/IR (no numerical or behavioural assertion).

Usage: python .ci/count_source_only_tests.py [pytest args...]   (default: the default run)

Method: collect the default run's items (``pytest --collect-only -q``); for each item, take the
test function's source plus the module-level helpers it calls (transitively, same module) and
look for two kinds of evidence:

- *source* evidence: it compiles or traces something, or reads generated text (``compile``,
  ``entry_ir``, ``inspect_source``, ``.script()``, ``check_fatbin``, ``cuda_sources``,
  ``re.search``/``findall``, ``.count(`` on text, ...);
- *behavioural* evidence: it runs something and checks a value or an error (NumPy comparisons,
  ``Engine``/``logits``/``generate``/``decode``, the CPU emulation, ``pytest.raises``, a
  subprocess that loads or runs the build, HF references, ...).

An item with source evidence and no behavioural evidence counts as compile/grep-only. It is a
heuristic: ``--list`` prints the items on each side so that a reader can check the borderline.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = re.compile(
    r"compile|entry_ir|inspect_source|\.script\(|check_fatbin|cuda_sources|_source\(|"
    r"re\.(search|findall|match)|\.count\(|kernels_without_wait|_kernels\(|"
    r"_entries\(|\bir\b|\bsrc\b|\bsource\b|\bscript\b|cuda_source"
)
BEHAVIOUR = re.compile(
    r"np\.|numpy|torch\.|allclose|assert_array|rel_l2|\.logits\(|\.generate\(|\.decode\(|"
    r"\.prefill\(|decode_greedy|launch_greedy|emulate\(|pytest\.raises|subprocess\.run|"
    r"hf_logits|hf_greedy|numpy_forward|Engine|\bvm\b|\.stream\(|\bmain\(|run_kernel|"
    r"reference|\bexpected\b|caplog|capsys|hf\.|assert_structural_equal|check_expert_kernels|"
    r"sha256|cache_key"
)


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _text(path: Path, name: str, funcs: dict, seen: set[str]) -> str:
    if name in seen or name not in funcs:
        return ""
    seen.add(name)
    node = funcs[name]
    text = ast.get_source_segment(path.read_text(), node) or ""
    text = "\n".join(line for line in text.splitlines() if not line.strip().startswith("#"))
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            text += _text(path, call.func.id, funcs, seen)
    return text


def classify(args: list[str]) -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    items = [line for line in out.splitlines() if "::" in line]
    groups: dict[str, list[str]] = {"source-only": [], "behavioural": [], "other": []}
    cache: dict[Path, dict] = {}
    for item in items:
        file, _, rest = item.partition("::")
        name = rest.split("::")[-1].split("[")[0]
        path = ROOT / file
        funcs = cache.setdefault(path, _functions(path))
        text = _text(path, name, funcs, set())
        body = text.split(":", 1)[1] if ":" in text else text  # not the signature's fixtures
        src, beh = bool(SOURCE.search(body)), bool(BEHAVIOUR.search(body))
        groups["behavioural" if beh else "source-only" if src else "other"].append(item)
    return groups


def main() -> None:
    show = "--list" in sys.argv
    groups = classify([a for a in sys.argv[1:] if a != "--list"] or ["tests"])
    total = sum(map(len, groups.values()))
    for kind, items in groups.items():
        print(f"{kind}: {len(items)}")
        if show:
            files = Counter(i.split("::")[0] for i in items)
            for item in items:
                print("   ", item)
            print("    by file:", dict(files))
    print(f"total: {total}")


if __name__ == "__main__":
    main()
