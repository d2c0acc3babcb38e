"""Where a greedy decode step's wall time goes beyond its graph's GPU time, on the GPU.

``python3 scripts/gpu_step_overhead.py BUILD --lib-dir TVM_LIB --out $OUT`` (GPU
machine, ``PYTHONPATH`` with the runtime and ``tvm_ffi``). One engine with decode graphs; after
a prompt of ``--prompt-len`` random ids and ``--warmup`` greedy steps (graphs captured and
trusted), it times, per step (us, median over ``--steps``):

* ``loop``: the bench's decode loop (``Engine.launch_greedy`` then ``PendingTokens.result``),
  with ``launch`` (the host until ``launch_greedy`` returns) and ``wait`` (in ``result``);
* ``replay``: the last step's graph replayed back to back, one sync at the end (GPU time);
* ``replay_sync``: the same graph launched and waited for, one at a time (+ launch and wake);
* ``kv_host``: ``begin_forward`` + the page tables' copy (``get_query_positions``) +
  ``end_forward`` + ``popn`` of one token, nothing launched (the KV cache's part of a step);
* ``graph_launch``: ``cudaGraphLaunch`` alone (host), the graph waited for outside the timer.

Writes ``step_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _median_us(values: list[float]) -> float:
    return 1e6 * float(np.median(values))


def _time_phases(engine, phases: dict[str, list[float]]) -> None:
    """Wrap the engine's host steps of a greedy decode step with timers (``phases``)."""

    def timed(name: str, fn):
        def wrapper(*a, **k):
            s0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases.setdefault(name, []).append(time.perf_counter() - s0)

        return wrapper

    engine._query_positions = timed("query_positions (page tables to the device)",
                                    engine._query_positions)  # fmt: skip
    engine._begin_forward = timed("begin_forward (next step, host)", engine._begin_forward)
    engine._checked_ids = timed("checked_ids", engine._checked_ids)
    fns = dict(engine._kv_state)
    fns["end_forward"] = timed("end_forward", fns["end_forward"])
    engine._kv_state = fns
    graphs = engine._graphs
    graphs.launch_greedy = timed("graphs.launch_greedy (copy ids + cudaGraphLaunch)",
                                 graphs.launch_greedy)  # fmt: skip
    graphs.wait_greedy = timed("wait_greedy (stream sync + tokens)", graphs.wait_greedy)
    engine._launch_greedy = timed("_launch_greedy (until the graph is launched)",
                                  engine._launch_greedy)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--warmup", type=int, default=160)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--replays", type=int, default=500)
    p.add_argument("--phases", action="store_true", help="time the host phases of a step")
    args = p.parse_args(argv)
    from dsv2_mlc.runtime.engine import Engine

    ctx = args.prompt_len + args.warmup + 2 * args.steps + 64
    engine = Engine(args.build, cuda_graph=True, context_window=ctx, max_batch_size=1,
                    lib_dir=args.lib_dir, random_weights=args.seed)  # fmt: skip
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, engine.config.vocab_size, args.prompt_len).tolist()
    seq = engine.add_sequence()
    token = int(engine.prefill([seq], [prompt])[0].argmax())
    report: dict = {"build": args.build, "prompt_len": args.prompt_len}

    def loop(n: int) -> tuple[list[float], list[float], list[float], int]:
        tok, total, launch, wait = token, [], [], []
        for _ in range(n):
            s0 = time.perf_counter()
            pending = engine.launch_greedy([seq], [tok])
            s1 = time.perf_counter()
            tok = int(pending.result()[0])
            s2 = time.perf_counter()
            total.append(s2 - s0)
            launch.append(s1 - s0)
            wait.append(s2 - s1)
        return total, launch, wait, tok

    loop(args.warmup)
    phases: dict[str, list[float]] = {}
    if args.phases:
        _time_phases(engine, phases)
    total, launch, wait, token = loop(args.steps)
    engine.settle()
    report["loop_us"] = _median_us(total)
    report["loop_launch_us"] = _median_us(launch)
    report["loop_wait_us"] = _median_us(wait)
    report["loop_p99_us"] = 1e6 * float(np.percentile(total, 99))
    report["graph_stats"] = engine.cuda_graph_stats
    if phases:
        report["phases_us"] = {
            k: {"p50": _median_us(v), "p90": 1e6 * float(np.percentile(v, 90)), "calls": len(v)}
            for k, v in phases.items()
        }

    graphs = engine._graphs
    if graphs is None:  # not CUDA: the loop only
        print(json.dumps(report), flush=True)
        return 0
    graph = next(reversed(graphs._graphs.values()))
    cuda, stream = graphs.cuda, graphs.stream
    cuda.synchronize(stream)
    start = time.perf_counter()
    for _ in range(args.replays):
        cuda.launch(graph.exe, stream)
    cuda.synchronize(stream)
    report["replay_us"] = 1e6 * (time.perf_counter() - start) / args.replays
    per, host = [], []
    for _ in range(args.replays):
        s0 = time.perf_counter()
        cuda.launch(graph.exe, stream)
        s1 = time.perf_counter()
        cuda.synchronize(stream)
        per.append(time.perf_counter() - s0)
        host.append(s1 - s0)
    report["replay_sync_us"] = _median_us(per)
    report["graph_launch_us"] = _median_us(host)

    kv, fns = [], engine._kv_state
    for _ in range(args.replays):
        s0 = time.perf_counter()
        engine._begin_forward([seq], [1])
        engine._query_positions(engine._cache)
        fns["end_forward"](engine._cache)
        fns["popn"](engine._cache, seq, 1)
        kv.append(time.perf_counter() - s0)
    cuda.synchronize(stream)
    report["kv_host_us"] = _median_us(kv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_overhead.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
