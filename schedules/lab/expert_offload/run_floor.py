"""Run the expert-offload floor study on the GPU machine and write one JSON report.

Runs ``pcie_floor`` (pinned copies, zero-copy reads of mapped host memory, the HBM reference)
and ``host_gemv`` (the routed experts on the host's cores, for a sweep of thread counts), both
built beforehand (the commands are in their headers and schedules/results/expert_offload.md),
and adds what each path's rate means for decode: a token reads 156 experts (0.696 GB), so its
expert time is ``token_bytes / rate``, and ``tok_s_bound`` is one over that (the experts only;
the rest of a step comes on top).

Usage: ``python3 schedules/lab/expert_offload/run_floor.py --bin-dir BIN --out REPORT.json``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TOKEN_BYTES = 156 * 4_460_544  # 26 MoE layers x 6 experts of q4f16_g128 V2-Lite


def _bound(gbps: float) -> dict[str, float]:
    ms = TOKEN_BYTES / (gbps * 1e9) * 1e3
    return {"token_expert_ms": round(ms, 3), "tok_s_bound": round(1e3 / ms, 1)}


def run_pcie(binary: Path) -> dict:
    out = subprocess.run([str(binary)], capture_output=True, text=True, check=True, timeout=900)
    data = json.loads(out.stdout)
    for section in ("memcpy", "zero_copy", "hbm_reference"):
        for row in data[section]:
            row.update(_bound(row["GBps"]))
    best = max(data["zero_copy"], key=lambda r: r["GBps"])
    best_layer = max(
        (r for r in data["zero_copy"] if r["case"].startswith("per_layer")),
        key=lambda r: r["GBps"],
    )
    data["best_zero_copy"] = best
    data["best_zero_copy_per_layer"] = best_layer
    return data


def run_host(binary: Path, threads: list[int]) -> list[dict]:
    rows = []
    for n in threads:
        env = {**os.environ, "OMP_NUM_THREADS": str(n), "OMP_PROC_BIND": "close"}
        out = subprocess.run(
            [str(binary)], capture_output=True, text=True, check=True, timeout=900, env=env
        )
        row = json.loads(out.stdout)
        row.update(_bound(row["GBps"]))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", type=Path, required=True, help="folder of the built binaries")
    ap.add_argument("--out", type=Path, required=True, help="the JSON report to write")
    ap.add_argument("--threads", default="1,2,4,8,16", help="host_gemv thread counts")
    ap.add_argument("--skip-gpu", action="store_true", help="host_gemv only")
    args = ap.parse_args(argv)
    report: dict = {"token_bytes": TOKEN_BYTES, "cpu_count": os.cpu_count()}
    if not args.skip_gpu:
        report["pcie"] = run_pcie(args.bin_dir / "pcie_floor")
    threads = [int(t) for t in args.threads.split(",")]
    report["host_gemv"] = run_host(args.bin_dir / "host_gemv", threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
