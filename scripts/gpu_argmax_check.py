"""The compiled greedy arg-max kernel (``greedy_tokens``) against ``np.argmax``, on the GPU.

``python3 scripts/gpu_argmax_check.py BUILD --lib-dir TVM_LIB --out $OUT`` (GPU
machine, ``PYTHONPATH`` with the runtime and ``tvm_ffi``). Runs the build's ``greedy_tokens``
on crafted logits ``[rows, 1, vocab]`` (random rows, ties, NaNs, infinities, signed zeros; rows
up to past the kernel's ticket counters; the build's vocabulary, its only one), each shape
``--repeat`` times back to back (the ticket counters must be back at 0 after every launch, with
the blocks of a row truly concurrent), and compares every result with ``np.argmax``. Writes
``argmax_check.json``; exit status 0 when every result matches (its GPU time:
``gpu_kernel_profile.py --graph --greedy``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def crafted(rows: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, 1, vocab]`` float32 logits with the cases of the kernel's docstring."""
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    for r in range(rows):
        kind = r % 6
        if kind == 1:  # ties: the first index wins
            x[r, rng.choice(vocab, size=min(vocab, 4), replace=False)] = x[r].max() + 1
        elif kind == 2:  # NaNs: the first one wins
            x[r, rng.choice(vocab, size=min(vocab, 3), replace=False)] = np.nan
        elif kind == 3:  # +inf, then all equal
            x[r, :] = 0.5
            x[r, rng.integers(vocab)] = np.inf
        elif kind == 4:  # signed zeros above negatives
            x[r, :] = -1.0
            x[r, rng.choice(vocab, size=min(vocab, 2), replace=False)] = [-0.0, 0.0][
                : min(vocab, 2)
            ]
        elif kind == 5:
            x[r, :] = -np.inf
    return x[:, None, :]


def check(build: str, lib_dir: str | None = None, repeat: int = 20) -> dict:
    """Every shape of the module docstring through the build's ``greedy_tokens``, ``repeat``
    launches each: the report (``wrong``: tokens that differ from ``np.argmax``)."""
    from dsv2_mlc.runtime.device import to_device, to_numpy
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(build, context_window=64, max_batch_size=1, lib_dir=lib_dir,
                 random_weights=0, cuda_graph=False)  # fmt: skip
    greedy = eng._greedy
    if greedy is None:
        raise ValueError(f"{build} has no greedy_tokens function")
    rng = np.random.default_rng(0)
    cases, bad = [], 0
    vocab = eng.config.vocab_size  # the compiled function's (only the rows are free)
    for rows in (1, 2, 3, 31, 64, 65, 70):
        for seed in range(3):
            x = crafted(rows, vocab, rng)
            ref = x[:, 0].argmax(-1)
            xt = to_device(x, "cuda")
            wrong = 0
            for _ in range(repeat):
                got = to_numpy(greedy(xt))
                wrong += int((got != ref).sum())
            cases.append({"rows": rows, "vocab": vocab, "seed": seed, "wrong": wrong})
            bad += wrong
    return {"build": build, "cases": cases, "wrong": bad}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="out")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    report = check(args.build, args.lib_dir, args.repeat)
    bad = report["wrong"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "argmax_check.json").write_text(json.dumps(report, indent=1))
    print("OK" if bad == 0 else "FAILED", f"{len(report['cases'])} shapes, {bad} wrong tokens")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
