"""Greedy tokens of one build stable across loads: the same weights, the same tokens.

``python3 scripts/gpu_reload_check.py BUILD --lib-dir TVM_LIB --out $OUT/reload.json`` (GPU
machine). Opens the build ``--loads`` times in one process (random weights ``--seed``, each engine
dropped before the next), prefills the same random prompt of ``--prompt-len`` ids and decodes
``--steps`` greedy tokens; reports each load's tokens and time, and whether all agree. For the
236B model this shows that weight creation, the kernels and the cache are deterministic at its
shapes (a race or an uninitialised buffer shows up as tokens that differ between loads).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("--lib-dir", default=None)
    p.add_argument("--out", default="reload.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--loads", type=int, default=2)
    args = p.parse_args(argv)
    from dsv2_mlc.runtime.engine import Engine

    runs = []
    for _ in range(args.loads):
        t0 = time.perf_counter()
        engine = Engine(args.build, context_window=args.prompt_len + args.steps + 16,
                        max_batch_size=1, lib_dir=args.lib_dir,
                        random_weights=args.seed)  # fmt: skip
        load_s = time.perf_counter() - t0
        rng = np.random.default_rng(args.seed)
        prompt = rng.integers(0, min(engine.config.vocab_size, 100000), args.prompt_len).tolist()
        seq = engine.add_sequence()
        token = int(engine.prefill([seq], [prompt])[0].argmax())
        tokens = [token]
        for _ in range(args.steps - 1):
            token = int(engine.decode_greedy([seq], [token])[0])
            tokens.append(token)
        runs.append({"load_s": load_s, "tokens": tokens})
        print(json.dumps(runs[-1]), flush=True)
        del engine
        gc.collect()
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    report = {"build": args.build, "prompt_len": args.prompt_len, "runs": runs, "identical": same}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"identical": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
