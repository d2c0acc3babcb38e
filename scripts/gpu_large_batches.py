"""Decode steps of 32 to 256 sequences on the GPU: which entry point serves a large batch.

``python3 -P scripts/gpu_large_batches.py BUILD --lib-dir TVM_LIB --out $OUT`` (GPU machine,
``PYTHONPATH`` with the runtime and ``tvm_ffi``). For each ``--batches`` size ``b``: one engine,
``b`` fresh sequences of ``--prompt-len`` random ids prefilled, then greedy steps (the device's
arg-max, tokens back) through each way of running a step of one token per sequence:

* ``groups``: the batch as groups of 31 sequences (what the engine ran before a step could take
  more), expert-major kernels, CUDA graphs;
* ``whole``: ``batch_decode_expert_major`` over the whole batch in one step (CUDA graphs);
* ``gemm``: ``batch_decode_gemm`` (the prefill path's GEMMs and grouped expert GEMMs, the decode
  path's attention) over the whole batch, CUDA graphs; ``gemm_eager``: the same without graphs;
* ``swap``: ``batch_decode_swap`` (sm_90 builds: ``batch_decode_gemm`` with the routed experts as
  the grouped GEMMs of ``moe_swap_cuda``), CUDA graphs;
* ``default``: the entry the engine picks for the batch by itself (CUDA graphs).

``check``: one step from the same cache state through ``whole`` and ``gemm`` (and ``swap`` where
the build has it): arg-max agreement and the largest logit difference. With ``--profile`` the
kernels of ``--profile-steps`` eager ``--profile-mode`` steps (default ``gemm``) at the largest
batch are recorded by CUPTI (torch.profiler); with ``--profile-prefill`` also the prefill of the
largest batch. Writes ``large_batches.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(step, n: int, toks: list[int]) -> tuple[list[float], list[int]]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        toks = step(toks)
        times.append(time.perf_counter() - t0)
    return times, toks


def run_batch(args: argparse.Namespace, b: int) -> dict:
    from dsv2_mlc.runtime.engine import Engine

    ctx = args.prompt_len + 4 * (args.warmup + args.steps) + 64
    largest = b == max(int(x) for x in args.batches.split(","))
    room = 2 * b if args.profile_prefill and largest else b  # the profiled prefill's sequences
    engine = Engine(args.build, cuda_graph=True, context_window=ctx, max_batch_size=room,
                    kv_capacity=room * ctx, prefill_chunk_size=args.prefill_chunk,
                    lib_dir=args.lib_dir, random_weights=args.seed)  # fmt: skip
    rng = np.random.default_rng(args.seed)
    seqs = [engine.add_sequence() for _ in range(b)]
    prompts = rng.integers(0, engine.config.vocab_size, (b, args.prompt_len)).tolist()
    t0 = time.perf_counter()
    toks = [int(row.argmax()) for row in engine.prefill(seqs, prompts)]
    _sync()
    report: dict = {"batch": b, "prefill_s": time.perf_counter() - t0}
    if args.profile_prefill and largest:
        report["prefill_profile"] = _profile_prefill(engine, rng, b, args.prompt_len)
    defaults = (engine._major_from, engine._gemm_from, engine._swap_from)

    def use(major: int | None, gemm: int | None, swap: int | None = None) -> None:
        engine.settle()
        if engine._graphs is not None:
            engine._graphs.clear()  # a key's graph is one entry point's
        has_major = "batch_decode_expert_major" in engine._fn
        engine._major_from, engine._gemm_from = (major if has_major else None), gemm
        engine._swap_from = swap if "batch_decode_swap" in engine._fn else None

    logits = {}
    ways = [("whole", None, None), ("gemm", 1, None)]
    if "batch_decode_swap" in engine._fn:
        ways.append(("swap", 1, 1))
    for name, gemm, swap in ways:  # the same step, same cache state
        use(1, gemm, swap)
        logits[name] = engine.decode(seqs, toks)
        for s in seqs:
            engine.popn(s, 1)
    report["check"] = {
        "argmax_agree": int((logits["whole"].argmax(-1) == logits["gemm"].argmax(-1)).sum()),
        "max_abs_diff": float(np.abs(logits["whole"] - logits["gemm"]).max()),
        "max_abs_logit": float(np.abs(logits["whole"]).max()),
    }
    if "swap" in logits:
        agree = int((logits["whole"].argmax(-1) == logits["swap"].argmax(-1)).sum())
        report["check"]["swap_argmax_agree"] = agree
        report["check"]["swap_max_abs_diff"] = float(np.abs(logits["whole"] - logits["swap"]).max())
    graphs = engine._graphs

    def greedy(ts: list[int]) -> list[int]:
        return [int(t) for t in engine.launch_greedy(seqs, ts, next_step=False).result()]

    def grouped(ts: list[int]) -> list[int]:
        out = []
        for i in range(0, b, 31):
            part = engine.launch_greedy(seqs[i : i + 31], ts[i : i + 31], next_step=False)
            out += [int(t) for t in part.result()]
        return out

    for name in args.modes.split(","):
        engine._graphs = graphs
        if name == "groups":
            use(16, None)
            step = grouped
        elif name == "whole":
            use(1, None)
            step = greedy
        elif name == "default":
            use(*defaults)
            step = greedy
        elif name in ("gemm", "gemm_eager"):
            use(1, 1)
            if name == "gemm_eager":
                engine._graphs = None
            step = greedy
        elif name == "swap":
            use(1, 1, 1)
            step = greedy
        else:
            raise SystemExit(f"unknown mode {name}")
        _, toks = _timed(step, args.warmup, toks)
        _sync()
        times, toks = _timed(step, args.steps, toks)
        med = float(np.median(times))
        report[name] = {"tok_s": b / med, "p50_ms": 1e3 * med,
                        "p99_ms": 1e3 * float(np.percentile(times, 99))}  # fmt: skip
        print(json.dumps({"batch": b, name: report[name]}), flush=True)
    engine._graphs = graphs
    report["graph_stats"] = engine.cuda_graph_stats
    if args.profile and largest:
        use(*{"gemm": (1, 1), "swap": (1, 1, 1), "whole": (1, None), "default": defaults}[
            args.profile_mode
        ])
        engine._graphs = None
        report["profile"] = _profile(greedy, toks, args.profile_steps)
    return report


def _profile_prefill(engine, rng, b: int, prompt_len: int) -> list[dict]:
    """CUPTI kernel times of one prefill of ``b`` fresh sequences (dropped afterwards)."""
    seqs = [engine.add_sequence() for _ in range(b)]
    prompts = rng.integers(0, engine.config.vocab_size, (b, prompt_len)).tolist()
    rows = _profile(lambda _: engine.prefill(seqs, prompts), [], 1)
    for s in seqs:
        engine.remove_sequence(s)
    return rows


def _profile(step, toks: list[int], steps: int) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            toks = step(toks)
        torch.cuda.synchronize()
    return _aggregate(prof, steps)


def _aggregate(prof, steps: int) -> list[dict]:
    agg: dict[str, list[float]] = defaultdict(list)
    for evt in prof.events():
        if str(getattr(evt, "device_type", None)).endswith("CUDA") and evt.device_time_total > 0:
            agg[evt.name[:90]].append(float(evt.time_range.end - evt.time_range.start))
    rows = [
        {"kernel": k, "calls_per_step": len(v) / steps, "us_per_step": sum(v) / steps}
        for k, v in agg.items()
    ]
    rows.sort(key=lambda r: -r["us_per_step"])
    for r in rows[:30]:
        print(f"{r['us_per_step']:10.1f} us {r['calls_per_step']:6.1f}x  {r['kernel']}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=16384)
    p.add_argument("--batches", default="32,64,128,256")
    p.add_argument("--modes", default="groups,whole,gemm,gemm_eager")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument(
        "--profile-mode", choices=("gemm", "swap", "whole", "default"), default="gemm"
    )
    p.add_argument("--profile-prefill", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for b in (int(x) for x in args.batches.split(",")):
        reports.append(run_batch(args, b))
        gc.collect()
        result = {"build": args.build, "prompt_len": args.prompt_len, "runs": reports}
        (out / "large_batches.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
