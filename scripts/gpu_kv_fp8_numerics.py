"""FP8 (e4m3) latent KV cache vs float16 on the GPU: two builds of the same model, same weights.

Device side (no TVM compiler there). Two builds of one config with random weights (``dsv2-mlc
compile CONFIG --random-weights --device cuda --quantization Q``, once plain and once with
``--kv-dtype fp8``) fill the same weights (seed 0). For each prompt length (random ids, seed
0) the float16-cache build prefills the prompt and decodes ``--steps`` greedy tokens; the FP8
build prefills the same prompt and decodes the *same* tokens (teacher forcing from the float16
run, so a disagreement does not compound). Reported per prompt length: the max |logit
difference| over the steps (and its median over steps), the largest |logit|, the top-1
agreement (the FP8 run's arg-max against the float16 run's token) and the float16 top-2 margin
where they part. One JSON object on stdout (and in ``--out``).

    python3 scripts/gpu_kv_fp8_numerics.py BUILD_F16 BUILD_FP8 --lib-dir TVM_LIB \\
        --out $OUT/kv_fp8.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dsv2_mlc.layout import BuildConfig
from dsv2_mlc.runtime.engine import Engine

VOCAB_IDS = 100000  # prompt ids are drawn below this (or the vocabulary size)


def open_engine(build: str, lib_dir: str | None, context: int, chunk: int) -> Engine:
    """``build`` with random weights 0, room for one sequence of ``context`` tokens."""
    return Engine(
        build,
        random_weights=0,
        lib_dir=lib_dir,
        context_window=context,
        max_batch_size=1,
        kv_capacity=context,
        prefill_chunk_size=chunk,
    )


def run(eng: Engine, prompt: list[int], steps: int, forced: list[int] | None):
    """Prefill ``prompt`` and decode ``steps`` tokens: greedy (``forced`` None) or the tokens
    ``forced``. Returns (the logits that chose each token ``[steps, vocab]``, the tokens)."""
    seq = eng.add_sequence()
    try:
        logits = [eng.prefill([seq], [prompt])[0]]
        tokens: list[int] = []
        for i in range(steps):
            tokens.append(int(np.argmax(logits[-1])) if forced is None else forced[i])
            logits.append(eng.decode([seq], [tokens[-1]])[0])
    finally:
        eng.remove_sequence(seq)
    return np.stack(logits[:steps]), tokens


def compare(fp8: np.ndarray, f16: np.ndarray, tokens: list[int]) -> dict:
    """The FP8 logits against the float16 ones (and the float16 run's tokens)."""
    diff = np.abs(fp8.astype(np.float64) - f16.astype(np.float64))
    agree = fp8.argmax(-1) == np.array(tokens)
    top2 = np.sort(f16, axis=-1)[:, -2:]
    return {
        "max_abs_diff": float(diff.max()),
        "median_step_max_abs_diff": float(np.median(diff.max(axis=-1))),
        "max_abs_logit": float(np.abs(f16).max()),
        "top1_agreement": float(agree.mean()),
        "disagreements": [
            {"step": int(j), "f16_top2_margin": float(top2[j, 1] - top2[j, 0])}
            for j in np.flatnonzero(~agree)
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("build_f16", help="the build with the float16 (default) KV cache")
    ap.add_argument("build_fp8", help="the same config compiled with --kv-dtype fp8")
    ap.add_argument("--lib-dir", default=None, help="TVM's runtime libraries")
    ap.add_argument("--prompt-lens", default="4096,32768")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk size")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    builds = {k: BuildConfig.read(p) for k, p in (("f16", args.build_f16), ("fp8", args.build_fp8))}
    if builds["fp8"].cache_dtype != "float8_e4m3fn" or builds["f16"].kv_dtype:
        raise SystemExit("pass the float16-cache build first, then the --kv-dtype fp8 build")
    lens = [int(x) for x in args.prompt_lens.split(",")]
    context = max(lens) + args.steps + 16
    rng = np.random.default_rng(0)
    vocab = min(VOCAB_IDS, int(builds["f16"].model["vocab_size"]))
    prompts = {n: rng.integers(0, vocab, n).tolist() for n in lens}
    report: dict = {
        "builds": {k: {"path": p, "kv_dtype": builds[k].cache_dtype,
                       "kv_bytes_per_token": builds[k].kv_bytes_per_token()}
                   for k, p in (("f16", args.build_f16), ("fp8", args.build_fp8))},
        "steps": args.steps,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cases": {},
    }  # fmt: skip
    t0 = time.perf_counter()
    ref = {}
    eng = open_engine(args.build_f16, args.lib_dir, context, args.chunk)
    for n in lens:
        ref[n] = run(eng, prompts[n], args.steps, None)
    del eng
    eng = open_engine(args.build_fp8, args.lib_dir, context, args.chunk)
    for n in lens:
        logits, _ = run(eng, prompts[n], args.steps, ref[n][1])
        report["cases"][str(n)] = compare(logits, ref[n][0], ref[n][1])
    report["seconds"] = time.perf_counter() - t0
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
