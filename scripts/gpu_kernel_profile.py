"""GPU time of every kernel of a decode step and of a prefill, from CUPTI (torch.profiler).

``python3 scripts/gpu_kernel_profile.py BUILD --lib-dir .devcarry/tvm-lib --out $OUT``
(GPU machine; torch for the profiler only, the model runs on our runtime): opens the build with
random weights, prefills ``--prompt-len`` tokens, then profiles ``--steps`` decode steps (eager,
so every kernel is its own launch; the kernels are the ones a graph replays) and one prefill of
``--prefill-len`` tokens. CUPTI records the device time of each kernel, whoever launched it, so
these are the kernels' own durations without launch or sync overhead (unlike ``bench
--profile``). Prints per-kernel tables (calls per step, mean us, total us per step, share) and
the sum of kernel time per decode step; writes ``kernel_profile.json``.
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


def _kernels(prof) -> list[tuple[str, float]]:
    out = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) is None:
            continue
        if str(evt.device_type).endswith("CUDA") and evt.device_time_total > 0:
            name = evt.name
            if name.startswith("Memcpy") or name.startswith("Memset"):
                name = name.split(" ")[0]
            out.append((name, float(evt.device_time_total)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    from dsv2_mlc.runtime.engine import Engine  # before torch: ours is the tvm_ffi in use

    ctx = max(args.prompt_len + args.steps + 8, args.prefill_len + 8)
    eng = Engine(args.build, context_window=ctx, max_batch_size=1, kv_capacity=ctx,
                 prefill_chunk_size=args.prefill_len, lib_dir=args.lib_dir, random_weights=0,
                 cuda_graph=False)  # fmt: skip
    import torch
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(0)
    vocab = eng.config.vocab_size
    seq = eng.add_sequence()
    token = int(eng.prefill([seq], [rng.integers(0, vocab, args.prompt_len).tolist()])[0].argmax())
    for _ in range(3):  # warm: kernels loaded
        token = int(eng.decode([seq], [token])[0].argmax())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            token = int(eng.decode([seq], [token])[0].argmax())
        torch.cuda.synchronize()
    decode = _table(_kernels(prof), args.steps)
    eng.remove_sequence(seq)
    report: dict = {"build": args.build, "prompt_len": args.prompt_len, "steps": args.steps}
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
