"""GPU time of every kernel of a decode step and of a prefill, from CUPTI (torch.profiler).

``python3 scripts/gpu_kernel_profile.py BUILD --lib-dir TVM_LIB --out $OUT``
(GPU machine; torch for the profiler only, the model runs on our runtime): opens the build with
random weights, prefills ``--batch`` sequences of ``--prompt-len`` tokens, then profiles
``--steps`` decode steps of them (eager, so every kernel is its own launch; the kernels are the
ones a graph replays) and one prefill of ``--prefill-len`` tokens. CUPTI records the device
time of each kernel, whoever launched it, so these are the kernels' own durations without
launch or sync overhead (unlike ``bench --profile``). Prints per-kernel tables (calls per step,
mean us, total us per step, share) and the sum of kernel time per decode step; writes
``kernel_profile.json``.

``--graph`` profiles ``--steps`` replays of a captured decode graph instead (with the build's
programmatic edges, as ``bench`` decodes; the context must stay within one graph key, e.g.
``--prompt-len 4032``: lengths 4,033-4,096 share one). There the kernels overlap (a kernel's
blocks start while its predecessor runs), so the sum of their durations is not a step's time;
the report adds the chain view (:func:`chain_table`): each kernel's *increment*, how far its end
moves the step's frontier past every earlier end (the increments of a step add up to its span,
first start to last end), and its *gap*, its start minus its predecessor's end (negative:
overlap), per kernel name and per step. ``--greedy`` decodes with ``Engine.decode_greedy``: the
step's arg-max kernel and its token copies (the greedy graph, what ``bench`` replays) included.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def _table(events: list[tuple[str, float]], per: int) -> list[dict]:
    agg: dict[str, list[float]] = defaultdict(list)
    for name, us in events:
        agg[name].append(us)
    total = sum(us for _, us in events)
    rows = [
        {
            "kernel": name,
            "calls_per": len(v) / per,
            "mean_us": float(np.mean(v)),
            "total_us_per": sum(v) / per,
            "share": sum(v) / total if total else 0.0,
        }
        for name, v in agg.items()
    ]
    return sorted(rows, key=lambda r: -r["total_us_per"])


def chain_table(events: list[tuple[str, float, float]], steps: int) -> dict:
    """The chain view of ``steps`` consecutive decode steps: ``events`` are every GPU activity
    ``(name, start_us, end_us)`` of them, the same sequence each step. Per kernel name: calls
    per step, mean duration, mean increment (``end - max(earlier ends of its step)``, at least
    0; a step's first activity: its duration) and total per step, mean gap to its predecessor
    (``start - previous end``; None for a step's first); and the span of each step."""
    if steps < 1 or len(events) % steps:
        raise ValueError(f"{len(events)} activities do not split into {steps} equal steps")
    events = sorted(events, key=lambda e: (e[1], e[2]))
    per = len(events) // steps
    agg: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    spans = []
    for k in range(steps):
        step = events[k * per : (k + 1) * per]
        frontier = step[0][1]
        for i, (name, start, end) in enumerate(step):
            a = agg[name]
            a["dur"].append(end - start)
            a["inc"].append(max(end - frontier, 0.0))
            if i:
                a["gap"].append(start - step[i - 1][2])
            frontier = max(frontier, end)
        spans.append(frontier - step[0][1])
    rows = [
        {
            "kernel": name,
            "calls_per": len(a["dur"]) / steps,
            "mean_us": float(np.mean(a["dur"])),
            "mean_increment_us": float(np.mean(a["inc"])),
            "increment_us_per": sum(a["inc"]) / steps,
            "mean_gap_us": float(np.mean(a["gap"])) if a["gap"] else None,
        }
        for name, a in agg.items()
    ]
    rows.sort(key=lambda r: -r["increment_us_per"])
    return {"rows": rows, "span_us": spans, "activities_per_step": per}


def _timeline(prof) -> list[tuple[str, float, float]]:
    """Every GPU activity of ``prof``: (kernel name, or ``Memcpy`` / ``Memset``, start us, end
    us)."""
    out = []
    for evt in prof.events():
        if str(getattr(evt, "device_type", None)).endswith("CUDA") and evt.device_time_total > 0:
            name = evt.name.split(" ")[0] if evt.name.startswith(("Memcpy", "Memset")) else evt.name
            out.append((name, float(evt.time_range.start), float(evt.time_range.end)))
    return out


def _kernels(prof) -> list[tuple[str, float]]:
    # (a device event's device_time_total is its time range)
    return [(name, end - start) for name, start, end in _timeline(prof)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="sequences a decode step")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--graph", action="store_true", help="profile decode graph replays")
    p.add_argument(
        "--greedy", action="store_true", help="greedy steps (the arg-max in the step's graph)"
    )
    args = p.parse_args(argv)
    from dsv2_mlc.runtime.engine import Engine  # before torch: ours is the tvm_ffi in use

    ctx = max(args.prompt_len + args.steps + 8, args.prefill_len + 8)
    b = args.batch
    eng = Engine(args.build, context_window=ctx, max_batch_size=b, kv_capacity=ctx * b,
                 prefill_chunk_size=max(args.prefill_len, args.prompt_len * b),
                 lib_dir=args.lib_dir, random_weights=0, cuda_graph=args.graph)  # fmt: skip
    import torch
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(0)
    vocab = eng.config.vocab_size
    seqs = [eng.add_sequence() for _ in range(b)]
    prompts = rng.integers(0, vocab, (b, args.prompt_len)).tolist()
    token = [int(row.argmax()) for row in eng.prefill(seqs, prompts)]

    def step(token: list[int]) -> list[int]:
        if args.greedy:
            return [int(t) for t in eng.decode_greedy(seqs, token)]
        return [int(t) for t in eng.decode(seqs, token).argmax(-1)]

    for _ in range(3):  # warm: kernels loaded (and with --graph: this key's graph captured)
        token = step(token)
    torch.cuda.synchronize()
    before = eng.cuda_graph_stats
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            token = step(token)
        torch.cuda.synchronize()
    decode = _table(_kernels(prof), args.steps)
    for seq in seqs:
        eng.remove_sequence(seq)
    report: dict = {"build": args.build, "prompt_len": args.prompt_len, "steps": args.steps,
                    "greedy": args.greedy, "batch": b}  # fmt: skip
    if args.graph:
        after = eng.cuda_graph_stats or {}
        replays = after.get("replays", 0) - (before or {}).get("replays", 0)
        if replays != args.steps or after.get("captures") != (before or {}).get("captures"):
            print(
                f"--graph: {replays} replays and new captures in {args.steps} steps: keep the "
                "context within one graph key (e.g. --prompt-len 4032)",
                file=sys.stderr,
            )
            return 1
        report["graph"] = after
        report["chain"] = chain_table(_timeline(prof), args.steps)
    report["decode"] = decode
    report["decode_kernel_us_per_step"] = sum(r["total_us_per"] for r in decode)
    report["decode_launches_per_step"] = sum(r["calls_per"] for r in decode)

    seq = eng.add_sequence()
    ids = rng.integers(0, vocab, args.prefill_len).tolist()
    eng.prefill([seq], [ids[:16]])
    eng.remove_sequence(seq)
    seq = eng.add_sequence()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.prefill([seq], [ids])
        torch.cuda.synchronize()
    report["prefill_wall_s"] = time.perf_counter() - t0
    prefill = _table(_kernels(prof), 1)
    report["prefill"] = prefill
    report["prefill_kernel_us"] = sum(r["total_us_per"] for r in prefill)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_profile.json").write_text(json.dumps(report, indent=1))

    if args.graph:
        chain = report["chain"]
        print(f"\n== decode graph replay: span {np.median(chain['span_us']):,.1f} us (median of "
              f"{args.steps}), {chain['activities_per_step']} activities; increment / gap / "
              "duration, us")  # fmt: skip
        for r in chain["rows"][: args.top]:
            gap = "" if r["mean_gap_us"] is None else f"{r['mean_gap_us']:7.2f}"
            print(f"{r['increment_us_per']:10.1f} us  {r['calls_per']:6.1f} x "
                  f"{r['mean_increment_us']:7.2f} {gap:>7} {r['mean_us']:7.2f}  "
                  f"{r['kernel'][:80]}")  # fmt: skip
    for phase, rows, per in (("decode step", decode, "step"), ("prefill", prefill, "call")):
        total = sum(r["total_us_per"] for r in rows)
        launches = sum(r["calls_per"] for r in rows)
        print(f"\n== {phase}: {total:,.1f} us of kernels, {launches:.0f} kernels per {per}")
        for r in rows[: args.top]:
            print(f"{r['total_us_per']:10.1f} us {100 * r['share']:5.1f}%  {r['calls_per']:6.1f} x "
                  f"{r['mean_us']:9.2f} us  {r['kernel'][:90]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
