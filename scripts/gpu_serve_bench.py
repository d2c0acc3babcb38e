"""``dsv2-mlc serve`` under ``dsv2-mlc bench-serve`` at several concurrencies, and ``dsv2-mlc
bench`` at batch 1 for the TPOT the server should match (run on a GPU machine).

For each concurrency a fresh server (its own process, on a free loopback port) serves BUILD with
random weights; a warm-up run at that concurrency (one request a client, 32 tokens each, so the
decode graphs of the batch sizes it meets are captured) precedes the measured run of
``max(16, 2 x concurrency)`` requests of PROMPT_LEN random token ids and GEN_LEN generated tokens.
The server's peak memory comes from its ``/metrics`` (``bench-serve`` reads it). Then, with no
server running, ``dsv2-mlc bench BUILD --prompt-len PROMPT_LEN --gen-len GEN_LEN --warmup 1
--repeat 2``. Everything is written to ``--out`` as JSON, one file a run plus ``summary.json``.

    python scripts/gpu_serve_bench.py BUILD --lib-dir TVM_LIB --out OUT
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsv2_mlc.cli", *args]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become ready")


def _bench_serve(url: str, out: Path, **kw: int) -> dict:
    args = ["bench-serve", url, "--json", str(out)]
    for key, value in kw.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    subprocess.run(_cli(*args), check=False, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build")
    ap.add_argument("--lib-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=31)
    ap.add_argument("--context-window", type=int, default=2048)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"serve": [], "args": vars(args)}
    for conc in (int(c) for c in args.concurrency.split(",")):
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        serve = ["serve", args.build, "--random-weights", "0", "--lib-dir", args.lib_dir]
        serve += ["--port", str(port), "--max-batch", str(args.max_batch)]
        serve += ["--context-window", str(args.context_window), "--log-level", "warning"]
        proc = subprocess.Popen(_cli(*serve))
        try:
            _wait_ready(url, proc)
            lens = {"prompt_len": args.prompt_len}
            _bench_serve(
                url,
                out / f"warmup-c{conc}.json",
                concurrency=conc,
                requests=conc,
                gen_len=32,
                **lens,
            )
            report = _bench_serve(
                url,
                out / f"serve-c{conc}.json",
                concurrency=conc,
                requests=max(16, 2 * conc),
                gen_len=args.gen_len,
                **lens,
            )
            summary["serve"].append(report)
            print(
                json.dumps(
                    {
                        k: report.get(k)
                        for k in (
                            "concurrency",
                            "completed",
                            "errors",
                            "output_token_throughput",
                            "ttft_p50_s",
                            "ttft_p99_s",
                            "tpot_p50_s",
                            "tpot_p99_s",
                            "server_memory_peak_bytes",
                        )
                    }
                ),
                flush=True,
            )
        finally:
            proc.terminate()
            proc.wait(60)
    bench_json = out / "bench-b1.json"
    bench = ["bench", args.build, "--prompt-len", str(args.prompt_len), "--gen-len"]
    bench += [str(args.gen_len), "--warmup", "1", "--repeat", "2", "--lib-dir", args.lib_dir]
    subprocess.run(_cli(*bench, "--json", str(bench_json)), check=True, stdout=subprocess.DEVNULL)
    summary["bench_b1"] = json.loads(bench_json.read_text())
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
