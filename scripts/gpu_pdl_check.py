"""Decode graphs with programmatic (PDL) kernel edges vs eager decode, on the GPU.

``python3 scripts/gpu_pdl_check.py BUILD --lib-dir TVM_LIB --out $OUT`` (GPU machine,
``PYTHONPATH`` with the runtime and ``tvm_ffi``; BUILD compiled with ``--pdl``, e.g.
``dsv2-mlc compile CONFIG --random-weights --device cuda --quantization q4f16_g128 --pdl``).
Opens the build once per variant with the same random weights: eager (no graphs) and decode
graphs with kernel edges ``off`` (plain, as captured), ``programmatic`` and
``launch-completion`` (``Engine(pdl=...)``, runtime/pdl.py). Then

1. prefill one prompt and decode ``--steps`` tokens on every engine, teacher-forced with the
   eager engine's arg-max (the context crosses graph keys every 64 tokens): the largest
   |logit difference| to eager per variant (0 expected: same kernels, and a missing wait would
   show up as a race), and the p50 wall time of a decode step;
2. replay the last step's graph ``--replays`` times back to back (it rewrites the same KV slot
   with the same values): GPU time per replay, then ``--checked-replays`` more, each compared
   bit for bit with the eager logits of that step.

Reports the programmatic edges per graph and the graph counters; writes ``pdl_check.json``.
Exit status 0 when every variant matches eager exactly and the PDL variants converted edges.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

GRAPH_VARIANTS = ("off", "programmatic", "launch-completion")


def run_pdl_check(
    build_dir: str,
    lib_dir: str | None = None,
    *,
    seed: int = 0,
    prompt_len: int = 500,
    steps: int = 200,
    replays: int = 1000,
    checked_replays: int = 50,
    variants: tuple[str, ...] = GRAPH_VARIANTS,
) -> dict:
    """Steps 1 and 2 of the module docstring on ``build_dir`` (compiled with ``--pdl``)."""
    from dsv2_mlc.layout import BuildConfig
    from dsv2_mlc.runtime.device import to_numpy
    from dsv2_mlc.runtime.engine import Engine

    build = BuildConfig.read(build_dir)
    if not build.pdl:
        raise ValueError(f"{build_dir} was not compiled with --pdl")
    kw = dict(context_window=prompt_len + steps + 16, max_batch_size=1,
              lib_dir=lib_dir, random_weights=seed)  # fmt: skip
    t0 = time.perf_counter()
    eager = Engine(build_dir, cuda_graph=False, **kw)
    engines = {v: Engine(build_dir, cuda_graph=True, pdl=v, **kw) for v in variants}
    print(f"{1 + len(engines)} engines loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    report: dict = {"build": build_dir, "pdl_launch_dependents": build.pdl_launch_dependents,
                    "steps": steps, "variants": {}}  # fmt: skip

    # 1. teacher-forced decode, every engine the same tokens
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, eager.config.vocab_size, prompt_len).tolist()
    seqs = {name: e.add_sequence() for name, e in [("eager", eager), *engines.items()]}
    ref = eager.prefill([seqs["eager"]], [prompt])[0]
    worst = {v: float(np.abs(e.prefill([seqs[v]], [prompt])[0] - ref).max())
             for v, e in engines.items()}  # fmt: skip
    times: dict[str, list[float]] = {v: [] for v in engines}
    token = int(ref.argmax())
    for _ in range(steps):
        ref = eager.decode([seqs["eager"]], [token])
        for v, e in engines.items():
            start = time.perf_counter()
            out = e.decode([seqs[v]], [token])
            times[v].append(time.perf_counter() - start)
            worst[v] = max(worst[v], float(np.abs(out - ref).max()))
        token = int(ref.argmax())
    last_ref = ref

    # 2. back-to-back replays of the last step's graph
    for v, e in engines.items():
        graphs = e._graphs
        graph = next(reversed(graphs._graphs.values()))
        cuda, stream = graphs.cuda, graphs.stream
        cuda.synchronize(stream)
        start = time.perf_counter()
        for _ in range(replays):
            cuda.launch(graph.exe, stream)
        cuda.synchronize(stream)
        replay_us = 1e6 * (time.perf_counter() - start) / max(replays, 1)
        replay_diff = 0.0
        for _ in range(checked_replays):
            cuda.launch(graph.exe, stream)
            cuda.synchronize(stream)
            logits = to_numpy(graph.out[0]).reshape(last_ref.shape)
            replay_diff = max(replay_diff, float(np.abs(logits - last_ref).max()))
        res = {
            "max_abs_diff": worst[v],
            "replay_max_abs_diff": replay_diff,
            "decode_step_ms_p50": 1e3 * float(np.median(times[v])),
            "replay_us": replay_us,
            "graphs": e.cuda_graph_stats,
            "last_error": graphs.last_error,
        }
        report["variants"][v] = res
        print(v, json.dumps(res), flush=True)

    return report


def failures(report: dict) -> list[str]:
    """What in a :func:`run_pdl_check` report is wrong (empty: every variant matches eager
    exactly, replays happened, and the PDL variants converted edges)."""
    bad = []
    for v, r in report["variants"].items():
        stats = r["graphs"] or {}
        if r["max_abs_diff"] != 0.0 or r["replay_max_abs_diff"] != 0.0:
            bad.append(f"{v}: logits differ from eager by {r['max_abs_diff']} (decode), "
                       f"{r['replay_max_abs_diff']} (back-to-back replays)")  # fmt: skip
        if not stats.get("replays", 0) or stats.get("mismatches", 0):
            bad.append(f"{v}: replays {stats.get('replays')}, mismatches {stats.get('mismatches')}")
        if v != "off" and (not stats.get("pdl_edges", 0) or stats.get("pdl_failures", 0)):
            bad.append(f"{v}: pdl_edges {stats.get('pdl_edges')}, pdl_failures "
                       f"{stats.get('pdl_failures')} ({r['last_error']})")  # fmt: skip
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=500)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--replays", type=int, default=1000, help="timed back-to-back replays")
    p.add_argument("--checked-replays", type=int, default=50, help="replays compared to eager")
    p.add_argument(
        "--variants", default=",".join(GRAPH_VARIANTS), help="graph edge variants to run"
    )
    args = p.parse_args(argv)
    from dsv2_mlc.layout import BuildConfig

    if not BuildConfig.read(args.build).pdl:
        print(f"{args.build} was not compiled with --pdl", file=sys.stderr)
        return 2
    report = run_pdl_check(
        args.build, args.lib_dir, seed=args.seed, prompt_len=args.prompt_len, steps=args.steps,
        replays=args.replays, checked_replays=args.checked_replays,
        variants=tuple(v for v in args.variants.split(",") if v),
    )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pdl_check.json").write_text(json.dumps(report, indent=1))
    res = report["variants"]
    summary = {v: (r["replay_us"], r["decode_step_ms_p50"], (r["graphs"] or {}).get("pdl_edges"))
               for v, r in res.items()}  # fmt: skip
    bad = failures(report)
    print("OK" if not bad else "FAILED: " + "; ".join(bad),
          "replay_us, step_ms_p50, pdl_edges:", json.dumps(summary))  # fmt: skip
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
