"""Build the same model with dlight's default schedules only (the per-kernel baseline).

``python scripts/build_dlight_baseline.py CONFIG OUT [--quantization q4f16_g128]`` compiles
``CONFIG`` with ``--random-weights`` for CUDA exactly as ``dsv2-mlc compile`` does, except that
the ``schedule`` phase runs dlight's rules alone (``ScheduleDecodeKernels``, our hand decode
schedules, is left out). Profiling both builds with ``scripts/gpu_kernel_profile.py`` gives the
"ours vs dlight default" columns of docs/benchmarks.md kernel by kernel.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("out")
    p.add_argument("--quantization", default="q4f16_g128")
    p.add_argument("--arch", default="sm_90")
    args = p.parse_args(argv)

    from dsv2_mlc.compiler.compile import compile_random_model
    from dsv2_mlc.passes import pipeline
    from dsv2_mlc.passes.schedule_decode_kernels import ScheduleDecodeKernels

    full = pipeline._schedule

    def dlight_only(target):  # noqa: ANN001, ANN202
        return [p for p in full(target) if p is not ScheduleDecodeKernels]

    phases = [(name, dlight_only if name == "schedule" else make) for name, make in pipeline.PHASES]
    pipeline.PHASES[:] = phases
    res = compile_random_model(
        args.config, args.out, device="cuda", quantization=args.quantization, arch=args.arch
    )
    print(f"built {res.out_dir} in {res.seconds:.1f} s (dlight schedules only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
