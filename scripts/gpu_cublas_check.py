"""The cuBLAS GEMM shim of a ``--gemm cublas`` build against torch, on the GPU, over a shape sweep.

``python3 scripts/gpu_cublas_check.py BUILD --lib-dir TVM_LIB --out $OUT`` (GPU
machine, ``PYTHONPATH`` with the runtime and ``tvm_ffi``, torch installed): loads the build's
library (which registers ``dsv2.cublas.*``, ``dsv2_mlc/runtime/cublas_gemm.cc``), opens cuBLAS
the way the engine does (:func:`dsv2_mlc.runtime.cublas.init_cublas`) and runs
``dsv2.cublas.gemm_nt(x, w, out)`` for every ``n`` of a sweep (1 row to 4K, odd counts included)
times the V2-Lite prefill weight shapes plus odd ones, fp16 and bf16 in, fp16 / bf16 / float32
out, against ``x.float() @ w.float().T`` (the reference). Also checks that bad calls raise
(shape mismatch, a float32 ``x``). Times each V2-Lite shape at ``n = 4096`` with CUDA events
(TFLOP/s), for the record only. Writes ``cublas_check.json``; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

N_SWEEP = (1, 7, 64, 129, 512, 1000, 4096)
SHAPES = {  # (out, in): V2-Lite's prefill GEMMs, then odd sizes
    "qkv_a": (3648, 2048),
    "kv_b half": (2048, 512),
    "o_proj": (2048, 2048),
    "shared gate/up": (5632, 2048),
    "shared down": (2048, 2816),
    "dense gate/up": (21888, 2048),
    "dense down": (2048, 10944),
    "odd": (72, 24),
    "odd2": (1000, 136),
}
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-3}  # relative L2


def check(build: str, lib_dir: str | None = None, timing: bool = True) -> dict:
    """The sweep and the bad calls of the module docstring (``timing``: also time the V2-Lite
    shapes): the report, ``failures`` counting the cases off tolerance and bad calls accepted."""
    import torch
    import tvm_ffi

    from dsv2_mlc.layout import LIBRARY
    from dsv2_mlc.runtime.cublas import init_cublas
    from dsv2_mlc.runtime.tvm_runtime import global_func, load_runtime

    load_runtime("cuda", lib_dir)
    library = tvm_ffi.load_module(str(Path(build) / LIBRARY))
    report: dict = {"build": build, "cublas": init_cublas(), "cases": [], "timing": {}}
    gemm = global_func("dsv2.cublas.gemm_nt")
    report["cublas_version"] = int(global_func("dsv2.cublas.version")(0))
    torch.manual_seed(0)
    failures = 0

    def run(x, w, out):  # noqa: ANN001, ANN202
        gemm(tvm_ffi.from_dlpack(x), tvm_ffi.from_dlpack(w), tvm_ffi.from_dlpack(out))

    for in_dtype in ("float16", "bfloat16"):
        for out_dtype in (in_dtype, "float32"):
            for name, (o, k) in SHAPES.items():
                w = torch.randn(o, k, device="cuda").to(getattr(torch, in_dtype)) / k**0.5
                for n in N_SWEEP:
                    x = torch.randn(n, k, device="cuda").to(getattr(torch, in_dtype))
                    out = torch.full((n, o), float("nan"), device="cuda",
                                     dtype=getattr(torch, out_dtype))  # fmt: skip
                    run(x, w, out)
                    torch.cuda.synchronize()
                    ref = x.float() @ w.float().T
                    rel = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                    ok = rel <= TOLERANCE[out_dtype] and bool(torch.isfinite(out).all())
                    failures += not ok
                    report["cases"].append(
                        {
                            "in": in_dtype,
                            "out": out_dtype,
                            "shape": name,
                            "n": n,
                            "o": o,
                            "k": k,
                            "rel_l2": rel,
                            "ok": ok,
                        }  # fmt: skip
                    )
            print(f"{in_dtype} -> {out_dtype}: {failures} failures so far", flush=True)

    errors = {}

    def zeros(*shape: int, dtype=torch.float16):  # noqa: ANN202
        return torch.zeros(*shape, device="cuda", dtype=dtype)

    bad = {
        "shape mismatch": (zeros(4, 64), zeros(8, 32), zeros(4, 8)),
        "float32 x": (zeros(4, 64, dtype=torch.float32), zeros(8, 64), zeros(4, 8)),
    }
    for label, args_ in bad.items():
        try:
            run(*args_)
            errors[label] = None
            failures += 1
        except Exception as err:  # noqa: BLE001
            errors[label] = str(err).splitlines()[0]
    report["errors"] = errors

    for name, (o, k) in SHAPES.items():
        if name.startswith("odd") or not timing:
            continue
        x = torch.randn(4096, k, device="cuda", dtype=torch.float16)
        w = torch.randn(o, k, device="cuda", dtype=torch.float16)
        out = torch.empty(4096, o, device="cuda", dtype=torch.float16)
        for _ in range(3):
            run(x, w, out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            run(x, w, out)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1000 / 20
        report["timing"][name] = {"us": us, "tflops": 2 * 4096 * o * k / us / 1e6}
    report["failures"] = failures
    del library
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    args = p.parse_args(argv)
    report = check(args.build, args.lib_dir)
    failures, errors = report["failures"], report["errors"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cublas_check.json").write_text(json.dumps(report, indent=1))
    worst = max(c["rel_l2"] for c in report["cases"])
    print(f"{len(report['cases'])} cases, {failures} failures, worst rel L2 {worst:.2e}; "
          f"errors {errors}; timing {report['timing']}")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
