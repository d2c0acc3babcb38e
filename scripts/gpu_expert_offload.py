"""The routed experts in host memory (``Engine(experts="host")``) against all-resident, on the GPU.

``python3 scripts/gpu_expert_offload.py BUILD --lib-dir TVM_LIB --prompt-len 4096 --gen-len 64
--out $OUT`` (GPU machine, ``PYTHONPATH`` with the runtime and ``tvm_ffi``; BUILD a random-weight
build, e.g. V2-Lite ``q4f16_g128``). For each placement in turn (``gpu`` first, then ``host``;
one engine at a time, the previous one collected): open the build with random weights (seed
``--seed``), prefill a prompt of ``--prompt-len`` random ids and generate ``--gen-len`` greedy
tokens (no stop token) once to warm up (kernels loaded, decode graphs captured) and once timed.
Each placement runs in a process of its own, so that neither inherits the other's device
memory (TVM's pooled allocator keeps what it freed).
Reports per placement: load seconds, TTFT (the timed run's prefill), decode tok/s, the weights'
bytes on each side (``Engine.weight_bytes``), the device memory in use (``cudaMemGetInfo``)
before the engine, after loading and after the runs; and how many of the greedy tokens the
placements share (``identical_tokens``: position by position; ``same_tokens``: all of them).
Writes ``expert_offload.json`` and prints it.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _used(device: str) -> int | None:
    """Device memory in use (``cudaMemGetInfo``); None on a CPU build (a smoke run)."""
    if device != "cuda":
        return None
    from dsv2_mlc.runtime.cudart import CudaRuntime

    got = CudaRuntime().memory_used()
    return None if got is None else got[0]


def run_placement(
    build: str, experts: str, lib_dir: str | None, prompt_len: int, gen_len: int, seed: int = 0
) -> dict:
    """One placement's row (see the module docstring); ``tokens`` are the timed run's."""
    from dsv2_mlc.layout import BuildConfig
    from dsv2_mlc.runtime.engine import Engine
    from dsv2_mlc.runtime.tvm_runtime import load_runtime

    device = BuildConfig.read(build).device
    load_runtime(device, lib_dir)
    gc.collect()
    before = _used(device)
    t0 = time.perf_counter()
    eng = Engine(build, context_window=prompt_len + gen_len + 16, max_batch_size=1,
                 lib_dir=lib_dir, random_weights=seed, experts=experts)  # fmt: skip
    load_s = time.perf_counter() - t0
    loaded = _used(device)
    prompt = np.random.default_rng(seed).integers(0, eng.config.vocab_size, prompt_len).tolist()
    eng.generate(prompt, gen_len, stop_token_ids=[])  # warm: kernels loaded, graphs captured
    res = eng.generate(prompt, gen_len, stop_token_ids=[])
    after = _used(device)
    row = {
        "experts": experts,
        "load_s": load_s,
        "ttft_ms": res.prefill_seconds * 1e3,
        "prefill_tok_s": res.prefill_tokens_per_second,
        "decode_tok_s": res.decode_tokens_per_second,
        "weight_bytes": eng.weight_bytes(),
        "gpu_used_before": before,
        "gpu_used_loaded": loaded,
        "gpu_used_after_runs": after,
        "gpu_used_by_engine": None if before is None or after is None else after - before,
        "tokens": res.token_ids,
    }
    del eng
    gc.collect()
    return row


def run_offload(
    build: str,
    lib_dir: str | None = None,
    *,
    prompt_len: int = 4096,
    gen_len: int = 64,
    seed: int = 0,
) -> dict:
    """Both placements' rows (each from a process of its own) and how their tokens compare."""
    rows = {}
    for experts in ("gpu", "host"):
        cmd = [sys.executable, str(Path(__file__).resolve()), build, "--placement", experts]
        cmd += ["--prompt-len", str(prompt_len), "--gen-len", str(gen_len), "--seed", str(seed)]
        if lib_dir is not None:
            cmd += ["--lib-dir", str(lib_dir)]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"experts={experts} failed:\n{run.stderr[-4000:]}")
        rows[experts] = json.loads(run.stdout.strip().splitlines()[-1])
        print(json.dumps({k: v for k, v in rows[experts].items() if k != "tokens"}), flush=True)
    ref, got = rows["gpu"]["tokens"], rows["host"]["tokens"]
    same = sum(a == b for a, b in zip(ref, got, strict=False))
    first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    saved = None
    if rows["gpu"]["gpu_used_by_engine"] is not None and rows["host"]["gpu_used_by_engine"]:
        saved = rows["gpu"]["gpu_used_by_engine"] - rows["host"]["gpu_used_by_engine"]
    return {
        "build": build,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "seed": seed,
        "identical_tokens": same,
        "of": len(ref),
        "first_difference": first,
        "same_tokens": ref == got,
        "gpu_bytes_saved": saved,
        "host_expert_bytes": rows["host"]["weight_bytes"]["host"],
        "decode_slowdown": rows["gpu"]["decode_tok_s"] / max(rows["host"]["decode_tok_s"], 1e-9),
        "placements": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out")
    p.add_argument("--placement", choices=("gpu", "host"), default=None,
                   help="run this placement only and print its row (one JSON line)")  # fmt: skip
    args = p.parse_args(argv)
    if args.placement is not None:
        row = run_placement(args.build, args.placement, args.lib_dir, args.prompt_len,
                            args.gen_len, args.seed)  # fmt: skip
        print(json.dumps(row), flush=True)
        return 0
    report = run_offload(args.build, args.lib_dir, prompt_len=args.prompt_len,
                         gen_len=args.gen_len, seed=args.seed)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "expert_offload.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print("OK" if report["same_tokens"] else "FAILED: the placements gave different tokens")
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
