"""The H200 baseline of docs/benchmarks.md: prepare the builds here, run ``dsv2-mlc bench`` there.

``python scripts/gpu_bench.py prepare`` (build box, needs TVM and nvcc, no GPU):

* compiles ``--config`` (a model's config.json, e.g. DeepSeek-V2-Lite's) for CUDA sm_90 in
  ``--quantization`` (default q4f16_g128) with ``--random-weights`` into
  ``build/bench/<name>`` (no weights: the runtime creates them on the GPU at load time);
* compiles the tiny test config A the same way (``build/bench/tiny``), for a smoke run first;
* copies the ``dsv2_mlc`` package into ``build/bench/src`` (the runtime that will run, frozen
  against concurrent edits) and writes ``build/bench/manifest.json`` (commit, uncommitted files,
  compile times, commands).

``python3 scripts/gpu_bench.py run --lib-dir TVM_LIB --out $OUT`` (GPU machine, with
``PYTHONPATH=build/bench/src:.site``): records the GPU and a torch HBM read bandwidth, then runs,
each in its own process (clean memory numbers), within ``--budget-s`` seconds:

1. smoke: the tiny build, every code path (``--profile --compare-hf``) in seconds;
2. V2-Lite, batch 1, prompt 512 / gen 128 (``--warmup 1 --repeat 3 --profile``);
3. V2-Lite, batch 1, prompt 4096 / gen 128 with ``--compare-hf`` (HF bf16 eager, 4K prefill and
   32 decode steps on the same weights); warm-up / repeats / profiling are cut to what the time
   left allows, from the 512 run's prefill time.

Writes ``env.json``, ``<step>.json`` reports and ``driver.log`` under ``--out``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "build" / "bench"


# -- here: builds ----------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> int:
    """Compile the builds, freeze the runtime copy, write the manifest."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_reference import CONFIG_A

    from dsv2_mlc.compiler.compile import compile_random_model

    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    tiny_cfg = BENCH_DIR / "tiny-config.json"
    tiny_cfg.write_text(json.dumps(CONFIG_A, indent=1))
    builds = {}
    for name, config, quant in (
        ("tiny", tiny_cfg, "q4f16_g32"),
        (args.name, Path(args.config), args.quantization),
    ):
        print(f"compiling {config} ({quant}, cuda {args.arch}) -> build/bench/{name}", flush=True)
        res = compile_random_model(
            config, BENCH_DIR / name, device="cuda", quantization=quant, arch=args.arch
        )
        builds[name] = {
            "config": str(config),
            "quantization": quant,
            "compile_s": round(res.seconds, 1),
            "library_bytes": (res.out_dir / "model.so").stat().st_size,
            "command": f"dsv2-mlc compile {config} --random-weights -o build/bench/{name} "
            f"--device cuda --quantization {quant}",
        }
    src = BENCH_DIR / "src" / "dsv2_mlc"
    shutil.rmtree(src.parent, ignore_errors=True)
    shutil.copytree(ROOT / "dsv2_mlc", src, ignore=shutil.ignore_patterns("__pycache__"))

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout

    manifest = {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "uncommitted": git("status", "--short").splitlines(),
        "prepared": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "builds": builds,
    }
    (BENCH_DIR / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps(manifest, indent=1))
    return 0


# -- there: runs -----------------------------------------------------------------------------------
class Driver:
    def __init__(self, out: Path, builds: Path, lib_dir: str, budget_s: float):
        self.out, self.builds, self.lib_dir = out, builds.resolve(), str(Path(lib_dir).resolve())
        self.deadline = time.monotonic() + budget_s
        self.log_file = open(out / "driver.log", "a")  # noqa: SIM115 (kept open for the run)

    def log(self, msg: str) -> None:
        print(msg, flush=True)
        self.log_file.write(msg + "\n")
        self.log_file.flush()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def bench(self, step: str, build: str, extra: list[str], timeout: float) -> dict | None:
        """One ``dsv2-mlc bench`` in its own process; its report, or None on failure."""
        report = self.out / f"{step}.json"
        cmd = [sys.executable, "-m", "dsv2_mlc.cli", "bench", str(self.builds / build)]
        cmd += [*extra, "--lib-dir", self.lib_dir, "--json", str(report)]
        shown = " ".join(["dsv2-mlc", *cmd[3:]]).replace(str(ROOT) + "/", "")
        self.log(f"\n== {step} (timeout {timeout:.0f} s): {shown}")
        t0 = time.monotonic()
        try:
            src = self.builds / "src"  # the frozen runtime copy (``-m`` puts the cwd first)
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=max(timeout, 5),
                check=False,
                cwd=src if (src / "dsv2_mlc").is_dir() else None,
            )
            output, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as err:
            output = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else ""
            rc = "timeout"
        lines = [ln for ln in output.splitlines() if "Warning: Fast mode" not in ln]
        self.log("\n".join(lines[-60:]))
        self.log(f"== {step}: rc {rc} in {time.monotonic() - t0:.1f} s")
        if rc == 0 and report.is_file():
            return json.loads(report.read_text())
        return None


def _env(driver: Driver, device: str) -> dict:
    env: dict = {"python": sys.version.split()[0]}
    try:
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
             "clocks.max.mem", "--format=csv"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except OSError as err:
        env["nvidia_smi"] = str(err)
    manifest = driver.builds / "manifest.json"
    env["manifest"] = json.loads(manifest.read_text()) if manifest.is_file() else None
    try:
        import torch
        import transformers

        env["torch"], env["transformers"] = torch.__version__, transformers.__version__
        if device != "cuda":
            raise RuntimeError("no CUDA device: bandwidth not measured")
        x = torch.empty(2**30, dtype=torch.float32, device="cuda").uniform_()  # 4 GiB
        for _ in range(3):
            x.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            x.sum()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        env["torch_read_bandwidth_bytes_s"] = 4 * 2**30 / sorted(times)[len(times) // 2]
        del x
        torch.cuda.empty_cache()
    except Exception as err:  # noqa: BLE001 (report, carry on)
        env["torch_error"] = repr(err)
    driver.log(json.dumps(env, indent=1))
    (driver.out / "env.json").write_text(json.dumps(env, indent=1))
    return env


def _plan_4k(r512: dict | None, left: float, hf: bool) -> list[str]:
    """Warm-up / repeat / profile for the 4K run that fit the time left."""
    if r512 is None:
        prefill, step = 30.0, 0.05
    else:
        prefill = 8.5 * r512["prefill"]["prefill_s_median"]
        step = 1.3 * r512["decode"]["tpot_ms_mean"] / 1e3
    run = prefill + 127 * step
    fixed = 30.0 + (150.0 if hf else 0.0)  # process start + engine load; HF build and run
    for warm, rep, prof in ((1, 3, 1), (1, 2, 1), (0, 2, 1), (0, 1, 1), (0, 1, 0)):
        if fixed + (1 + warm + rep) * run + prof * (prefill + 8 * step) < left:
            break
    args = ["--warmup", str(warm), "--repeat", str(rep)]
    return args + (["--profile"] if prof else [])


def run(args: argparse.Namespace) -> int:
    """The device-side sequence (module docstring)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    driver = Driver(out, Path(args.builds), args.lib_dir, args.budget_s)
    _env(driver, args.device)
    lite = args.name
    smoke = driver.bench(
        "smoke",
        "tiny",
        ["--prompt-len", "32", "--gen-len", "8", "--warmup", "0", "--repeat", "1", "--profile",
         "--profile-steps", "2", "--compare-hf"],
        min(150, driver.left()),
    )  # fmt: skip
    hf_ok = smoke is not None
    if smoke is None:  # retry without the HF side, to tell the two apart
        smoke = driver.bench(
            "smoke-nohf", "tiny", ["--prompt-len", "32", "--gen-len", "8", "--repeat", "1"], 90
        )
    base = ["--batch", "1", "--gen-len", "128"]
    r512 = driver.bench(
        "lite-512",
        lite,
        [*base, "--prompt-len", "512", "--warmup", "1", "--repeat", "3", "--profile"],
        min(300, driver.left() - 200),
    )
    plan = _plan_4k(r512, driver.left(), hf_ok)
    hf_args = ["--compare-hf", "--hf-decode-tokens", "32"] if hf_ok else []
    r4k = driver.bench(
        "lite-4096", lite, [*base, "--prompt-len", "4096", *plan, *hf_args], driver.left() - 5
    )
    driver.log("\n== summary")
    for name, r in (("smoke", smoke), ("lite-512", r512), ("lite-4096", r4k)):
        if r is None:
            driver.log(f"{name}: no result")
            continue
        d, p, f = r["decode"], r["prefill"], r["roofline"]
        line = (
            f"{name}: prefill {p['prefill_tok_s']:,.0f} tok/s (TTFT {p['ttft_ms_median']:.1f} ms)"
            f", decode {d['decode_tok_s']:,.1f} tok/s (TPOT p50 {d['tpot_ms_p50']:.2f} p99 "
            f"{d['tpot_ms_p99']:.2f} ms), {100 * f.get('fraction_of_hbm', 0):.1f}% of HBM, peak "
            f"{(r['memory'].get('peak_bytes') or 0) / 2**30:.2f} GiB"
        )
        if "hf" in r:
            h = r["hf"]
            line += (
                f"; HF prefill {h['prefill_tok_s']:,.0f} decode {h['decode_tok_s']:.2f} tok/s "
                f"-> x{h['ratio_prefill_tok_s']:.2f} / x{h['ratio_decode_tok_s']:.1f}"
            )
        driver.log(line)
    return 0 if (r512 and r4k) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="compile the builds here (no GPU needed)")
    p.add_argument("--config", required=True, help="the model's config.json (V2-Lite's, say)")
    p.add_argument("--quantization", default="q4f16_g128")
    p.add_argument("--name", default="v2-lite-q4f16_g128")
    p.add_argument("--arch", default="sm_90")
    p.set_defaults(func=prepare)
    p = sub.add_parser("run", help="run the benchmarks (GPU machine)")
    p.add_argument("--lib-dir", default=None, help="folder of libtvm_runtime*.so")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--name", default="v2-lite-q4f16_g128")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--builds", default=str(BENCH_DIR), help="folder of the prepared builds")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the driver on CPU builds")
    p.set_defaults(func=run)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
