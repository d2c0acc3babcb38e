"""Greedy generation with and without overlapped steps (``Engine.overlap_steps``), on the GPU.

``python3 scripts/gpu_generate_overlap.py BUILD --lib-dir TVM_LIB --out $OUT`` (GPU
machine, ``PYTHONPATH`` with the runtime and ``tvm_ffi``). One engine; a prompt of
``--prompt-len`` random ids; then ``Engine.stream`` of ``--tokens`` new tokens (no stop token),
the consumer busy for ``--consumer-us`` microseconds on every delta (what a chat front end or an
HTTP server does with each token), alternating ``overlap_steps`` True / False in the same
process for ``--rounds`` rounds. Reports decode tok/s (the generation's own ``decode_seconds``)
per setting, median over the rounds, and checks that both settings give the same tokens.
Writes ``generate_overlap.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def run_overlap(
    build: str,
    lib_dir: str | None = None,
    *,
    prompt_len: int = 4000,
    tokens: int = 128,
    consumer_us: tuple[float, ...] = (0.0, 100.0, 300.0),
    rounds: int = 3,
) -> dict:
    """The rounds of the module docstring: the report (``same_tokens``: every generation, in
    both settings, gave the first one's tokens)."""
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(build, context_window=prompt_len + tokens + 16, max_batch_size=1,
                 lib_dir=lib_dir, random_weights=0)  # fmt: skip
    prompt = np.random.default_rng(0).integers(0, eng.config.vocab_size, prompt_len).tolist()

    def run(overlap: bool, consumer: float) -> tuple[float, list[int]]:
        eng.overlap_steps = overlap
        stream = eng.stream(prompt, tokens, stop_token_ids=[])
        for _ in stream:
            _busy(consumer)
        assert stream.result is not None
        return stream.result.decode_tokens_per_second, stream.result.token_ids

    ref = run(True, 0)[1]  # warm: graphs captured
    rows, same = [], True
    for consumer in consumer_us:
        tok_s: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for overlap in (True, False):
                rate, got = run(overlap, consumer)
                tok_s[overlap].append(rate)
                same = same and got == ref
        row = {
            "consumer_us": consumer,
            "overlap_tok_s": float(np.median(tok_s[True])),
            "no_overlap_tok_s": float(np.median(tok_s[False])),
            "runs": {str(k): v for k, v in tok_s.items()},
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
    return {"build": build, "prompt_len": prompt_len, "tokens": tokens, "same_tokens": same,
            "reference_tokens": ref, "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--consumer-us", default="0,100,300")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    report = run_overlap(
        args.build, args.lib_dir, prompt_len=args.prompt_len, tokens=args.tokens,
        consumer_us=tuple(float(c) for c in args.consumer_us.split(",")), rounds=args.rounds,
    )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate_overlap.json").write_text(json.dumps(report, indent=1))
    same = report["same_tokens"]
    print("OK" if same else "FAILED: the settings gave different tokens", flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
