"""Greedy decode over new page buckets with decode graphs moved (default) or captured per bucket.

``python3 scripts/gpu_graph_moves.py BUILD --lib-dir TVM_LIB --out $OUT`` (GPU
machine, ``PYTHONPATH`` with the runtime and ``tvm_ffi``). One engine with decode graphs. A
warm-up generation (prompt 300, 256 steps) makes the graph keys trusted and lets the graphs of
one batch size learn how they move (``runtime/graph_relocation.py``). Then runs alternate
between the two modes (``DecodeGraphs.relocate`` on / off); each run prefills a new prompt of
``base + 1024 * run`` random ids (so no run meets a bucket an earlier one cached) and decodes
``--gen-len`` greedy tokens as ``bench`` does (``launch_greedy`` with the next step begun). Per
run: decode tok/s, step p50 / p99 / max (ms), the captures and moves it made and the median
step of each kind (a step launched ahead moves the next step's graph while it runs: the move
counts in the step that made it). Writes ``graph_moves.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _run(engine, prompt: list[int], gen_len: int) -> dict:
    graphs = engine._graphs
    seq = engine.add_sequence()
    try:
        token = int(engine.prefill([seq], [prompt])[0].argmax())
        steps, kinds, tokens = [], [], []
        for i in range(gen_len - 1):
            before = (graphs.stats["captures"], graphs.stats["relocations"])
            s0 = time.perf_counter()
            pending = engine.launch_greedy([seq], [token], next_step=i < gen_len - 2)
            token = int(pending.result()[0])
            steps.append(time.perf_counter() - s0)
            after = (graphs.stats["captures"], graphs.stats["relocations"])
            kinds.append("capture" if after[0] > before[0] else
                         "move" if after[1] > before[1] else "replay")  # fmt: skip
            tokens.append(token)
    finally:
        engine.settle()
        engine.remove_sequence(seq)
    ms = 1e3 * np.array(steps)
    by_kind = {k: [float(m) for m, kk in zip(ms, kinds, strict=True) if kk == k]
               for k in ("capture", "move", "replay")}  # fmt: skip
    return {
        "prompt_len": len(prompt),
        "decode_tok_s": len(steps) / float(np.sum(steps)),
        "step_ms_p50": float(np.median(ms)),
        "step_ms_p99": float(np.percentile(ms, 99)),
        "step_ms_max": float(ms.max()),
        "captures": len(by_kind["capture"]),
        "moves": len(by_kind["move"]),
        "median_ms": {k: float(np.median(v)) if v else None for k, v in by_kind.items()},
        "tokens_head": tokens[:8],
        "tokens": tokens,
    }


def eager_greedy(engine, prompt: list[int], gen_len: int) -> list[int]:  # noqa: ANN001
    """The tokens :func:`_run` decodes, from ``engine`` step by step with the host's arg-max
    (an engine without graphs: the reference of the moved graphs)."""
    seq = engine.add_sequence()
    try:
        token = int(engine.prefill([seq], [prompt])[0].argmax())
        tokens = []
        for _ in range(gen_len - 1):
            token = int(engine.decode([seq], [token])[0].argmax())
            tokens.append(token)
    finally:
        engine.remove_sequence(seq)
    return tokens


def moves_against_eager(
    build: str, lib_dir: str | None = None, *, seed: int = 0, base: int = 4096, gen_len: int = 256
) -> dict:
    """The warm-up, then one run with moves on over a prompt of ``base`` random ids (buckets
    the warm-up never met) and the same greedy decode on an engine without graphs: the run's
    report with ``eager_tokens`` and the engine's graph counters (``graph_stats``)."""
    from dsv2_mlc.runtime.engine import Engine

    kw = dict(context_window=base + gen_len + 64, max_batch_size=1, lib_dir=lib_dir,
              random_weights=seed)  # fmt: skip
    engine = Engine(build, cuda_graph=True, **kw)
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    _run(engine, rng.integers(0, vocab, 300).tolist(), 256)
    engine._graphs.relocate = True
    prompt = rng.integers(0, vocab, base).tolist()
    res = _run(engine, prompt, gen_len)
    res["graph_stats"] = engine.cuda_graph_stats
    res["last_error"] = engine._graphs.last_error
    del engine
    res["eager_tokens"] = eager_greedy(Engine(build, cuda_graph=False, **kw), prompt, gen_len)
    return res


def _differences(graphs, group: tuple, limit: int = 60) -> list[dict]:
    """Every node argument that differs between the cached graphs of ``group`` (by bucket):
    the kernel's name, the values and, for each, the owned buffer it points into."""
    import ctypes

    from dsv2_mlc.runtime.graph_relocation import owner

    found = sorted((g.bucket, g) for k, g in graphs._graphs.items()
                   if (k[0], *k[2:]) == group and g.template)  # fmt: skip
    snaps = [(b, g, graphs._snapshot(g)) for b, g in found]
    name_of = graphs.cuda._cu("cuFuncGetName")
    rows = []
    for i, node in enumerate(snaps[0][2]):
        for j in range(len(node.args)):
            values = [s[i].args[j] if j < len(s[i].args) else b"" for _, _, s in snaps]
            if len(set(values)) == 1:
                continue
            name = ctypes.c_char_p()
            if node.kind == 0:
                name_of(ctypes.byref(name), ctypes.c_void_p(node.fixed[0]))
            ints = [int.from_bytes(v, "little") for v in values]
            rows.append({
                "node": i, "arg": j, "size": len(values[0]),
                "kernel": (name.value or b"").decode()[:80] if node.kind == 0 else node.kind,
                "buckets": [b for b, _, _ in snaps], "values": [hex(v) for v in ints],
                "owners": [owner(v, g.owned) for v, (_, g, _) in zip(ints, snaps, strict=True)],
            })  # fmt: skip
            if len(rows) >= limit:
                return rows
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bases", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--gen-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--diagnose", action="store_true", help="stop after the warm-up's differences")
    args = p.parse_args(argv)
    from dsv2_mlc.runtime.engine import Engine

    runs = 2 * args.repeats
    ctx = max(args.bases) + 1024 * runs + args.gen_len + 64
    engine = Engine(args.build, cuda_graph=True, context_window=ctx, max_batch_size=1,
                    lib_dir=args.lib_dir, random_weights=args.seed)  # fmt: skip
    graphs = engine._graphs
    rng = np.random.default_rng(args.seed)
    vocab = engine.config.vocab_size
    report: dict = {"build": args.build, "gen_len": args.gen_len, "runs": []}
    report["warmup"] = _run(engine, rng.integers(0, vocab, 300).tolist(), 256)
    report["warmup"].pop("tokens")
    print("warm-up", json.dumps(report["warmup"]), flush=True)
    if args.diagnose:  # what differs between the warm-up's graphs, then stop
        report["differences"] = _differences(graphs, (1, "greedy"))
        for row in report["differences"][:24]:
            print(json.dumps(row), flush=True)
        return _write(args.out, report)
    for base in args.bases:
        for r in range(runs):
            mode = "move" if r % 2 else "capture"
            graphs.relocate = mode == "move"
            prompt = rng.integers(0, vocab, base + 1024 * r).tolist()
            res = {"mode": mode, **_run(engine, prompt, args.gen_len)}
            res.pop("tokens")
            report["runs"].append(res)
            print(json.dumps(res), flush=True)
    report["graph_stats"] = engine.cuda_graph_stats
    report["last_error"] = graphs.last_error
    print(json.dumps(report["graph_stats"]), report["last_error"], flush=True)
    return _write(args.out, report)


def _write(out_dir: str, report: dict) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_moves.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
