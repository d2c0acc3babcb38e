"""The generated CUDA and the device code of a CUDA build, for before/after checks of a change.

``python scripts/cuda_digest.py CONFIG.json OUT_DIR [--quantization q4f16_g128] [--arch sm_90]``
compiles ``CONFIG.json`` with random weights for CUDA (as ``dsv2-mlc compile CONFIG.json
--random-weights --device cuda``) into ``OUT_DIR/build``, writes every CUDA source TVM generated
(``OUT_DIR/source<i>.cu``) and every fatbin nvcc returned (``OUT_DIR/device<i>.fatbin``), and
prints one JSON line: the sha256 of the sources and of the device code. A change that only
moves or renames product code leaves both unchanged; one that adds emulation-only branches
(``#else`` of ``__CUDA_ARCH__``) changes the sources but not the device code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="a model config.json")
    p.add_argument("out", help="folder for the build, the sources and the fatbins")
    p.add_argument("--quantization", default="q4f16_g128")
    p.add_argument("--arch", default="sm_90")
    args = p.parse_args()

    import tvm
    import tvm.support.nvcc as nvcc

    from dsv2_mlc.compiler.compile import compile_random_model
    from dsv2_mlc.compiler.cuda import cuda_sources

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sources: list[str] = []
    fatbins: list[bytes] = []
    compile_tvm, compile_cuda = tvm.compile, nvcc.compile_cuda

    def recording_compile(*a, **k):  # noqa: ANN002, ANN003, ANN202
        executable = compile_tvm(*a, **k)
        sources.extend(cuda_sources(executable.mod))
        return executable

    def recording_nvcc(*a, **k):  # noqa: ANN002, ANN003, ANN202
        binary = compile_cuda(*a, **k)
        fatbins.append(bytes(binary))
        return binary

    tvm.compile, nvcc.compile_cuda = recording_compile, recording_nvcc
    start = time.perf_counter()
    compile_random_model(
        args.config, out / "build", device="cuda", quantization=args.quantization, arch=args.arch
    )
    for i, source in enumerate(sorted(sources)):
        (out / f"source{i}.cu").write_text(source)
    for i, binary in enumerate(sorted(fatbins)):
        (out / f"device{i}.fatbin").write_bytes(binary)
    report = {
        "source_sha256": hashlib.sha256("".join(sorted(sources)).encode()).hexdigest(),
        "device_sha256": hashlib.sha256(b"".join(sorted(fatbins))).hexdigest(),
        "sources": len(sources),
        "source_bytes": sum(map(len, sources)),
        "fatbins": len(fatbins),
        "seconds": round(time.perf_counter() - start),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
