"""Long-prompt prefill on the GPU: TTFT, time per chunk and peak memory per prefill chunk size.

``python3 scripts/gpu_long_prefill.py BUILD --lib-dir TVM_LIB --prompt-len 131072 --chunks
8192,16384 --out $OUT`` (GPU machine, ``PYTHONPATH`` with the runtime, ``tvm_ffi`` and the
repository). Each case runs in its own child process (the engine's allocator pools and never
frees, so a fresh process is the only clean memory high-water mark):

* ``--chunks``: the ``--prompt-len`` prompt (random ids) prefilled in chunks of that size (one
  ``batch_prefill`` call, then ``batch_extend`` calls attending to the cached prefix, as
  ``Engine.prefill`` runs any prompt longer than its chunk);
* ``--one-call`` (default 32768): a prompt of that length in one call, and the same prompt in
  chunks of the first ``--chunks`` size, for comparison.

Per case: after a short warm-up (a 16-token prefill and a 32-token extend on another sequence, so
every kernel is loaded), each chunk is one ``Engine.prefill`` call timed on the host until its
logits are on the host (that copy waits for the chunk's kernels), and ``cudaMemGetInfo`` is
sampled after it. TTFT = the sum of the chunks + the host arg-max of the last logits. Memory:
``before_load`` (CUDA context), ``after_load`` (+ weights + the KV cache pool), ``peak`` (max over
the samples); ``workspace = peak - after_load`` is what the prefill calls allocated (their
activations). Writes ``long_prefill.json`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

GIB = 1024**3


def _engine(build: str, lib_dir: str | None, prompt_len: int, chunk: int, seed: int) -> Any:
    from dsv2_mlc.layout import PARAMS_DIR
    from dsv2_mlc.runtime.engine import Engine

    has_params = (Path(build) / PARAMS_DIR / "tensor-cache.json").is_file()
    ctx = prompt_len + 64
    return Engine(
        build,
        context_window=ctx,
        max_batch_size=1,
        kv_capacity=ctx,
        prefill_chunk_size=chunk,
        lib_dir=lib_dir,
        random_weights=None if has_params else seed,
        cuda_graph=False,
    )


def _used(cuda: Any) -> int | None:
    got = cuda.memory_used() if cuda is not None else None
    return None if got is None else int(got[0])


def run_case(
    build: str, lib_dir: str | None, prompt_len: int, chunk: int, seed: int
) -> dict[str, Any]:
    """One prompt of ``prompt_len`` random ids prefilled in chunks of ``chunk`` (this process)."""
    from dsv2_mlc.layout import BuildConfig
    from dsv2_mlc.runtime.cudart import CudaRuntime
    from dsv2_mlc.runtime.tvm_runtime import load_runtime

    build_cfg = BuildConfig.read(build)
    load_runtime(build_cfg.device, lib_dir)
    try:
        cuda = CudaRuntime()
    except RuntimeError:
        cuda = None
    before = _used(cuda)
    t0 = time.perf_counter()
    engine = _engine(build, lib_dir, prompt_len, chunk, seed)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    warm = engine.add_sequence()  # every kernel loaded: a prefill, then an extend
    engine.prefill([warm], [rng.integers(0, vocab, 16).tolist()])
    engine.prefill([warm], [rng.integers(0, vocab, 32).tolist()])
    engine.remove_sequence(warm)
    after_load = _used(cuda)

    prompt = rng.integers(0, vocab, prompt_len).tolist()
    seq = engine.add_sequence()
    chunks: list[dict[str, Any]] = []
    peak = after_load
    logits = None
    for start in range(0, prompt_len, chunk):
        piece = prompt[start : start + chunk]
        s0 = time.perf_counter()
        logits = engine.prefill([seq], [piece])[0]  # one model call: len(piece) <= chunk
        seconds = time.perf_counter() - s0
        used = _used(cuda)
        if used is not None:
            peak = used if peak is None else max(peak, used)
        chunks.append(
            {"prefix": start, "tokens": len(piece), "seconds": seconds, "used_bytes": used}
        )
    a0 = time.perf_counter()
    first_token = int(np.argmax(logits))
    argmax_s = time.perf_counter() - a0
    times = [c["seconds"] for c in chunks]
    ttft = sum(times) + argmax_s
    cache_bytes = build_cfg.kv_bytes_per_token() * engine.kv_capacity
    weight_bytes = sum(
        int(np.prod([int(d) for d in t.shape])) * np.dtype(str(t.dtype)).itemsize
        for _, t in engine.named_params()
    )
    return {
        "prompt_len": prompt_len,
        "chunk": chunk,
        "calls": len(chunks),
        "ttft_s": ttft,
        "prefill_tok_s": prompt_len / sum(times),
        "first_chunk_s": times[0],
        "later_chunks_s_mean": float(np.mean(times[1:])) if len(times) > 1 else None,
        "last_chunk_s": times[-1],
        "first_token": first_token,
        "load_s": load_s,
        "memory": {
            "source": "cudaMemGetInfo, sampled after loading and after every chunk",
            "before_load_bytes": before,
            "after_load_bytes": after_load,
            "peak_bytes": peak,
            "workspace_bytes": None if None in (peak, after_load) else peak - after_load,
            "weight_bytes": weight_bytes,
            "kv_cache_bytes_at_capacity": cache_bytes,
            "peak_gib": None if peak is None else peak / GIB,
        },
        "chunks": chunks,
    }


def _child(args: argparse.Namespace, prompt_len: int, chunk: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, args.build, "--seed", str(args.seed)]
    cmd += ["--case", f"{prompt_len}:{chunk}"]
    if args.lib_dir:
        cmd += ["--lib-dir", args.lib_dir]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.case_timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"prompt_len": prompt_len, "chunk": chunk, "error": "timeout",
                "seconds": time.perf_counter() - t0}  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"prompt_len": prompt_len, "chunk": chunk, "error": done.stderr[-3000:]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default=None, help="folder for long_prefill.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=131072)
    p.add_argument("--chunks", default="8192,16384", help="chunk sizes, comma-separated")
    p.add_argument("--one-call", type=int, default=32768, help="one-call comparison (0: none)")
    p.add_argument("--case-timeout", type=float, default=540.0, help="seconds per child")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # PROMPT:CHUNK, in a child
    args = p.parse_args(argv)
    if args.case:
        prompt_len, chunk = (int(v) for v in args.case.split(":"))
        print(json.dumps(run_case(args.build, args.lib_dir, prompt_len, chunk, args.seed)))
        return 0
    chunks = [int(c) for c in args.chunks.split(",") if c]
    cases = [(args.prompt_len, c) for c in chunks]
    if args.one_call:
        cases += [(args.one_call, args.one_call), (args.one_call, chunks[0])]
    report: dict[str, Any] = {"build": args.build, "cases": []}
    for prompt_len, chunk in cases:
        print(f"case prompt {prompt_len} chunk {chunk}", file=sys.stderr, flush=True)
        result = _child(args, prompt_len, chunk)
        report["cases"].append(result)
        brief = {k: result.get(k) for k in ("ttft_s", "first_chunk_s", "later_chunks_s_mean")}
        peak = result.get("memory", {}).get("peak_gib")
        print(f"  {brief} peak {peak} GiB {result.get('error', '')}", file=sys.stderr, flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "long_prefill.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
