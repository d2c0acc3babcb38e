"""Decode from CUDA graphs vs eager decode, same build and weights, on the GPU.

``python3 scripts/gpu_graph_check.py BUILD --lib-dir TVM_LIB --out $OUT`` (GPU machine,
``PYTHONPATH`` with the runtime and ``tvm_ffi``): opens the build twice with the same random
weights, once with ``cuda_graph=True`` and once without, and runs the same steps on both,
teacher-forced with the eager engine's arg-max:

1. one sequence: prompt 500, 300 decode steps (context 500 -> 800: the graph key changes every
   64 tokens), then ``popn(40)`` and 30 more steps (back to earlier keys);
2. two sequences (prompts 100 and 37) decoded together for 100 steps;
3. a fork of sequence 1 decoded with its parent (shared pages: the engine must fall back to
   eager steps);
4. greedy on the device: two sequences, 100 steps of ``decode_greedy`` on the graph engine (the
   arg-max kernel captured in the step's graph, the ids copied in and the tokens copied out
   through pinned host memory) against the host arg-max of the eager engine's logits;
5. the same for one sequence (prompt 180: keys change every 64 tokens), 150 steps, then
   ``popn(30)`` and 40 more steps (back to earlier greedy graphs);
6. launched greedy steps (``launch_greedy`` with the next step begun ahead, as ``bench`` and
   greedy generation run them): two sequences (prompts 230 and 90), 130 steps, ``popn(20)`` on
   both (which undoes the step begun ahead) and 30 more.

Per case: the largest |logit difference| between the two engines (the kernels are the same and
deterministic, so 0 is expected), or for 4 and 5 the steps whose tokens differ (0 expected; the
greedy graphs must have been replayed, ``greedy_replays``, without a failed first-replay check),
and the graph counters. Writes ``graph_check.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def run_checks(build: str, lib_dir: str | None = None, seed: int = 0) -> dict:
    """Every case of the module docstring on ``build`` (random weights ``seed``): the report."""
    from dsv2_mlc.runtime.engine import Engine

    kw = dict(context_window=1024, max_batch_size=4, lib_dir=lib_dir, random_weights=seed)
    t0 = time.perf_counter()
    graph = Engine(build, cuda_graph=True, **kw)
    eager = Engine(build, cuda_graph=False, **kw)
    print(f"engines loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(seed)
    vocab = graph.config.vocab_size
    report: dict = {"build": build, "cases": {}}

    def steps(seqs: dict[str, list[int]], tokens: list[int], n: int) -> dict:
        worst, times = 0.0, []
        for _ in range(n):
            t = time.perf_counter()
            a = graph.decode(seqs["graph"], tokens)
            times.append(time.perf_counter() - t)
            b = eager.decode(seqs["eager"], tokens)
            worst = max(worst, float(np.abs(a - b).max()))
            tokens = b.argmax(-1).tolist()
        return {"steps": n, "max_abs_diff": worst, "graph_step_ms_p50": 1e3 * np.median(times),
                "tokens": tokens}  # fmt: skip

    def start(prompts: list[list[int]]) -> tuple[dict, list[int], float]:
        seqs = {"graph": [graph.add_sequence() for _ in prompts],
                "eager": [eager.add_sequence() for _ in prompts]}  # fmt: skip
        a = np.stack(graph.prefill(seqs["graph"], prompts))
        b = np.stack(eager.prefill(seqs["eager"], prompts))
        return seqs, b.argmax(-1).tolist(), float(np.abs(a - b).max())

    def case(name: str, body) -> None:
        before = dict(graph.cuda_graph_stats or {})
        res = body()
        after = graph.cuda_graph_stats or {}
        res["graphs"] = {k: after[k] - before.get(k, 0) for k in after}
        res.pop("tokens", None)
        report["cases"][name] = res
        print(name, json.dumps(res), flush=True)

    prompt = rng.integers(0, vocab, 500).tolist()
    seqs, tokens, prefill_diff = start([prompt])

    def single() -> dict:
        res = steps(seqs, tokens, 300)
        res["prefill_max_abs_diff"] = prefill_diff
        return res

    case("single_500_to_800", single)

    def popped() -> dict:
        graph.popn(seqs["graph"][0], 40)
        eager.popn(seqs["eager"][0], 40)
        return steps(seqs, [int(rng.integers(0, vocab))], 30)

    case("popn_40_then_30", popped)

    def forked() -> dict:
        child = {"graph": [graph.fork_sequence(seqs["graph"][0])],
                 "eager": [eager.fork_sequence(seqs["eager"][0])]}  # fmt: skip
        both = {k: seqs[k] + child[k] for k in seqs}
        return steps(both, [int(rng.integers(0, vocab))] * 2, 20)

    case("fork_with_parent", forked)
    graph.reset()
    eager.reset()

    def batch2() -> dict:
        pair, toks, diff = start([rng.integers(0, vocab, 100).tolist(),
                                  rng.integers(0, vocab, 37).tolist()])  # fmt: skip
        res = steps(pair, toks, 100)
        res["prefill_max_abs_diff"] = diff
        return res

    case("batch2", batch2)
    graph.reset()
    eager.reset()

    def greedy_steps(
        seqs: dict[str, list[int]], toks: list[int], n: int, launched: bool = False
    ) -> dict:
        """``n`` greedy steps on the graph engine (pinned-memory replays; ``launched``: through
        ``launch_greedy``, the next step begun ahead) against the host arg-max of the eager
        engine's logits, each engine fed its own tokens."""
        ours, times, bad = list(toks), [], 0
        for _ in range(n):
            t = time.perf_counter()
            if launched:
                got = graph.launch_greedy(seqs["graph"], ours, next_step=True).result()
            else:
                got = graph.decode_greedy(seqs["graph"], ours)
            times.append(time.perf_counter() - t)
            assert got.dtype == np.int64 and got.shape == (len(toks),), (got.dtype, got.shape)
            ref = eager.decode(seqs["eager"], toks).argmax(-1).tolist()
            bad += got.tolist() != ref
            ours, toks = got.tolist(), ref
        return {"steps": n, "token_mismatches": bad, "on_device": graph.has_device_greedy,
                "graph_step_ms_p50": 1e3 * np.median(times), "tokens": toks}  # fmt: skip

    def greedy2() -> dict:
        pair, toks, _ = start([rng.integers(0, vocab, 200).tolist(),
                               rng.integers(0, vocab, 61).tolist()])  # fmt: skip
        return greedy_steps(pair, toks, 100)

    case("greedy_batch2", greedy2)
    graph.reset()
    eager.reset()

    def greedy_popn(prompts: list[int], n: int, pop: int, more: int, launched: bool) -> dict:
        """``n`` greedy steps, ``popn(pop)`` on every sequence of both engines, ``more`` steps."""
        seqs, toks, _ = start([rng.integers(0, vocab, p).tolist() for p in prompts])
        res = greedy_steps(seqs, toks, n, launched)
        for engine, name in ((graph, "graph"), (eager, "eager")):
            for seq in seqs[name]:
                engine.popn(seq, pop)
        again = [int(rng.integers(0, vocab))] * len(prompts)
        rest = greedy_steps(seqs, again, more, launched)
        res["steps"] += rest["steps"]
        res["token_mismatches"] += rest["token_mismatches"]
        return res

    case("greedy_single_popn", lambda: greedy_popn([180], 150, 30, 40, launched=False))
    graph.reset()
    eager.reset()

    case("launched_batch2_popn", lambda: greedy_popn([230, 90], 130, 20, 30, launched=True))
    report["graph_totals"] = graph.cuda_graph_stats
    report["last_error"] = graph._graphs.last_error if graph._graphs else None
    return report


def failures(report: dict) -> list[str]:
    """What in a :func:`run_checks` report is wrong (empty: graphs and eager steps agree)."""
    bad = []
    for name, c in report["cases"].items():
        if c.get("max_abs_diff", 0.0) != 0.0:
            bad.append(f"{name}: logits differ from eager by {c.get('max_abs_diff')}")
        if c.get("token_mismatches", 0):
            bad.append(f"{name}: {c['token_mismatches']} of {c['steps']} steps' tokens differ")
        if name.startswith(("greedy", "launched")):  # through the pinned-memory graphs
            if not c["graphs"].get("greedy_replays", 0):
                bad.append(f"{name}: no greedy graph replayed")
            if c["graphs"].get("mismatches", 0):
                bad.append(f"{name}: {c['graphs']['mismatches']} failed first-replay checks")
    if not (report["graph_totals"] or {}).get("replays", 0):
        bad.append(f"no graph replayed ({report['last_error']})")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    report = run_checks(args.build, args.lib_dir, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_check.json").write_text(json.dumps(report, indent=1))
    bad = failures(report)
    print("OK" if not bad else "MISMATCH: " + "; ".join(bad), json.dumps(report["graph_totals"]))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
