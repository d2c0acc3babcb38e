"""Greedy decode of a batch of mixed lengths from a fresh engine: graphs vs eager, on the GPU.

``python3 scripts/gpu_graph_mixed.py BUILD --lib-dir TVM_LIB --out $OUT`` (GPU machine,
``PYTHONPATH`` with the runtime and ``tvm_ffi``). Opens the build twice with the same random
weights, with and without decode graphs, prefills ``--batch`` prompts of lengths drawn from
[16, ``--max-prompt``] on both, then runs ``--steps`` greedy steps as ``bench`` does
(``launch_greedy`` with the next step begun ahead) on the graph engine against the host arg-max
of the eager engine's logits, each engine fed its own tokens. With many sequences of different
lengths some sequence crosses a 16-token page at almost every step, so the graph key
``(batch, ceil(pages / 4))`` changes at almost every step and rarely recurs: no graph would be
replayed if keys had to recur to be checked. The graphs of a fresh engine are untrusted, so the
run shows the whole path: captures that teach the move, moved graphs checked against an eager
step until the keys are trusted, then moved graphs replayed (``runtime/cuda_graph.py``); where
the graphs cannot move (``batch_decode_gemm``, from 32 sequences), eager steps for the keys that
just changed and captures only of keys that stay.

Reports the steps whose tokens differ (0 expected), how many steps changed key, the graph
counters, each step's kind (capture / checked move / move / replay) and the median step of each
kind on the graph engine. Writes ``graph_mixed.json``; exits 1 on a mismatch or where no graph
was moved and replayed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

KINDS = ("capture", "checked_move", "move", "replay", "eager")


def _kind(before: dict, after: dict) -> str:
    """What a step did, from the graph counters around it (a move made for the next step while
    this one ran counts in this step)."""
    d = {k: after[k] - before[k] for k in ("captures", "checks", "relocations", "replays")}
    if d["captures"]:
        return "capture"
    if d["relocations"] and d["checks"]:
        return "checked_move"
    if d["relocations"]:
        return "move"
    return "replay" if d["replays"] else "eager"


def run(build: str, lib_dir: str | None, batch: int, max_prompt: int, steps: int,
        seed: int) -> dict:  # fmt: skip
    """The report of the module docstring."""
    from dsv2_mlc.runtime.cuda_graph import decode_graph_key
    from dsv2_mlc.runtime.engine import PAGE_SIZE, Engine

    kw = dict(context_window=max_prompt + steps + 16, max_batch_size=batch, lib_dir=lib_dir,
              random_weights=seed)  # fmt: skip
    t0 = time.perf_counter()
    graph = Engine(build, cuda_graph=True, **kw)
    eager = Engine(build, cuda_graph=False, **kw)
    print(f"engines loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(seed)
    vocab = graph.config.vocab_size
    lengths = rng.integers(16, max_prompt + 1, batch).tolist()
    prompts = [rng.integers(0, vocab, n).tolist() for n in lengths]
    seqs = {"graph": [graph.add_sequence() for _ in prompts],
            "eager": [eager.add_sequence() for _ in prompts]}  # fmt: skip
    graph.prefill(seqs["graph"], prompts)
    toks = np.stack(eager.prefill(seqs["eager"], prompts)).argmax(-1).tolist()
    ours, bad, kinds, times, keys = list(toks), 0, [], [], []
    stats = graph._graphs.stats
    for i in range(steps):
        keys.append(decode_graph_key(PAGE_SIZE, [n + i + 1 for n in lengths]))
        before = dict(stats)
        t = time.perf_counter()
        got = graph.launch_greedy(seqs["graph"], ours, next_step=i < steps - 1).result()
        times.append(time.perf_counter() - t)
        kinds.append(_kind(before, stats))
        ref = eager.decode(seqs["eager"], toks).argmax(-1).tolist()
        bad += got.tolist() != ref
        ours, toks = got.tolist(), ref
    by_kind = {k: [1e3 * t for t, x in zip(times, kinds, strict=True) if x == k] for k in KINDS}
    return {
        "build": build, "batch": batch, "prompt_lengths": [min(lengths), max(lengths)],
        "steps": steps, "token_mismatches": bad,
        "key_changes": sum(a != b for a, b in zip(keys, keys[1:], strict=False)),
        "graphs": dict(stats), "last_error": graph._graphs.last_error,
        "kinds": "".join(k[0] if k != "checked_move" else "C" for k in kinds),
        "count_by_kind": {k: len(v) for k, v in by_kind.items()},
        "step_ms_p50_by_kind": {k: float(np.median(v)) for k, v in by_kind.items() if v},
        "step_ms_p50": float(1e3 * np.median(times)),
    }  # fmt: skip


def failures(report: dict) -> list[str]:
    """What in a :func:`run` report is wrong (empty: graphs agree with eager and were used)."""
    bad = []
    if report["token_mismatches"]:
        bad.append(f"{report['token_mismatches']} of {report['steps']} steps' tokens differ")
    g = report["graphs"]
    if g["mismatches"]:
        bad.append(f"{g['mismatches']} failed first-replay checks ({report['last_error']})")
    # graphs that move are moved and replayed; those that cannot (batch_decode_gemm's cuBLAS
    # nodes) leave the steps whose key just changed eager
    if not ((g["relocations"] and g["greedy_replays"]) or g.get("eager_unseen")):
        bad.append(f"neither moved graphs nor eager steps for new keys ({report['last_error']})")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    report = run(a.build, a.lib_dir, a.batch, a.max_prompt, a.steps, a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_mixed.json").write_text(json.dumps(report, indent=1))
    bad = failures(report)
    print(json.dumps(report))
    print("OK" if not bad else "MISMATCH: " + "; ".join(bad))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
