"""Decode throughput against the batch size, on the GPU: token-major vs expert-major MoE kernels.

``python3 -P scripts/gpu_decode_batches.py BUILD --lib-dir TVM_LIB --out $OUT`` (GPU
machine, ``PYTHONPATH`` with the runtime and ``tvm_ffi``; a CUDA build with
``batch_decode_expert_major``). For each ``--batches`` size ``b``: one engine (graphs on),
``b`` fresh sequences of ``--prompt-len`` random ids prefilled, then

* ``check``: one step of all ``b`` sequences from the same cache state through ``batch_decode``
  (the fused per-token MoE kernels) and ``batch_decode_expert_major`` (each expert the batch
  selects read once): the arg-max agreement and the largest logit difference;
* ``token`` / ``expert``: greedy steps (``Engine.launch_greedy`` + its result, what ``generate``
  and ``bench`` run; CUDA graphs) with ``expert_major_from`` off / 1, alternating ``--rounds``
  times: tok/s (``b`` / median step) and the steps' p50 / p99.

Writes ``decode_batches.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np


def _steps(engine, seqs: list[int], toks: list[int], n: int) -> tuple[list[float], list[int]]:
    step_s = []
    for _ in range(n):
        s0 = time.perf_counter()
        toks = [int(t) for t in engine.launch_greedy(seqs, toks).result()]
        step_s.append(time.perf_counter() - s0)
    engine.settle()
    return step_s, toks


def run_batch(args: argparse.Namespace, b: int) -> dict:
    from dsv2_mlc.runtime.engine import Engine

    ctx = args.prompt_len + 2 * args.rounds * (args.warmup + args.steps) + 64
    engine = Engine(args.build, cuda_graph=True, context_window=ctx, max_batch_size=b,
                    kv_capacity=b * ctx, prefill_chunk_size=args.prefill_chunk,
                    lib_dir=args.lib_dir, random_weights=args.seed)  # fmt: skip
    if "batch_decode_expert_major" not in engine._fn:
        raise SystemExit(f"{args.build}: no batch_decode_expert_major (compile it again)")
    rng = np.random.default_rng(args.seed)
    seqs = [engine.add_sequence() for _ in range(b)]
    prompts = rng.integers(0, engine.config.vocab_size, (b, args.prompt_len)).tolist()
    toks = [int(row.argmax()) for row in engine.prefill(seqs, prompts)]
    logits = {}
    for name, start in (("token", None), ("expert", 1)):
        engine._graphs.clear()  # a key's graph is one entry point's
        engine._major_from = start
        logits[name] = engine.decode(seqs, toks)
        for seq in seqs:
            engine.popn(seq, 1)
    report: dict = {
        "batch": b,
        "check": {
            "argmax_agree": int((logits["token"].argmax(-1) == logits["expert"].argmax(-1)).sum()),
            "max_abs_diff": float(np.abs(logits["token"] - logits["expert"]).max()),
            "max_abs_logit": float(np.abs(logits["token"]).max()),
            # rows whose arg-max differs: their top-2 margin (token-major): a near tie flips
            "flipped_margins": [
                float(np.diff(np.sort(row)[-2:])[0])
                for row, other in zip(logits["token"], logits["expert"], strict=True)
                if row.argmax() != other.argmax()
            ],
        },
    }
    runs: dict[str, list[float]] = {"token": [], "expert": []}
    for _ in range(args.rounds):
        for name, start in (("token", None), ("expert", 1)):
            engine.settle()
            engine._graphs.clear()
            engine._major_from = start
            _, toks = _steps(engine, seqs, toks, args.warmup)
            step_s, toks = _steps(engine, seqs, toks, args.steps)
            runs[name].append(b / float(np.median(step_s)))
            report.setdefault(f"{name}_steps_ms", []).append(
                [1e3 * float(np.median(step_s)), 1e3 * float(np.percentile(step_s, 99))]
            )
    for name, tok_s in runs.items():
        report[name] = {"tok_s": tok_s, "tok_s_median": float(np.median(tok_s))}
    report["graph_stats"] = engine.cuda_graph_stats
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--batches", default="1,2,3,4,6,8,16,31")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for b in (int(x) for x in args.batches.split(",")):
        reports.append(run_batch(args, b))
        gc.collect()  # the engine (its weights, cache and graphs) goes before the next one
        print(json.dumps(reports[-1]), flush=True)
        result = {"build": args.build, "prompt_len": args.prompt_len, "runs": reports}
        (out / "decode_batches.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
