"""V2-Lite-shape numerics on the GPU: our fp16 build vs HF transformers on the same random weights.

Device side (no TVM compiler there). Our build (``dsv2-mlc compile CONFIG --random-weights
--device cuda --quantization q0f16``) creates its weights on the GPU; ``load_into_hf`` copies the
same weights into ``DeepseekV2ForCausalLM`` (fp16, eager). We prefill a random prompt, decode
``--steps`` tokens greedily, then run HF once over prompt + our tokens (teacher forcing) and
compare the logits that predicted each generated token: max |difference| and top-1 agreement.
``--batch B`` decodes B sequences (each its own random prompt) in every step, so that steps of
``EXPERT_MAJOR_FROM`` sequences and more run the expert-major MoE kernels
(``batch_decode_expert_major``); ``--expert-major-from N`` moves that threshold (0: never, the
token-major kernels at every batch; 1: every step, batch 1 included).

    PYTHONPATH=build/v2n/src:.site python3 scripts/gpu_v2lite_numerics.py \\
        --build build/v2n/v2-lite-q0f16 --lib-dir .devcarry/tvm-lib --out $OUT/v2lite.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from dsv2_mlc.hf_export import load_into_hf
from dsv2_mlc.runtime.engine import EXPERT_MAJOR_FROM, Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--build", required=True)
    ap.add_argument("--lib-dir", default=None)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded in each step")
    ap.add_argument(
        "--expert-major-from",
        type=int,
        default=EXPERT_MAJOR_FROM,
        help="steps of this many sequences and more run the expert-major MoE kernels (0: none)",
    )
    ap.add_argument("--out", default="v2lite_numerics.json")
    ap.add_argument(
        "--save-logits", default=None, help="also save our logits (.npy), to compare builds"
    )
    args = ap.parse_args()

    t0 = time.perf_counter()
    b, context = args.batch, max(1024, args.prompt_len + args.steps)
    eng = Engine(
        args.build,
        random_weights=args.seed,
        lib_dir=args.lib_dir,
        context_window=context,
        max_batch_size=b,
        kv_capacity=context * b,
        prefill_chunk_size=max(512, args.prompt_len * b),  # one prefill call, as `bench` runs it
        expert_major_from=args.expert_major_from or None,
    )
    prompts = np.random.default_rng(args.seed).integers(0, 100000, (b, args.prompt_len)).tolist()
    seqs = [eng.add_sequence() for _ in range(b)]
    logits = [eng.prefill(seqs, prompts)]
    tokens: list[list[int]] = []
    for _ in range(args.steps):
        tokens.append([int(t) for t in np.argmax(logits[-1], axis=-1)])
        logits.append(eng.decode(seqs, tokens[-1]))
    ours = np.stack(logits[: args.steps], axis=1)  # [b, steps, vocab]
    if args.save_logits:
        np.save(args.save_logits, ours)
    t1 = time.perf_counter()

    hf = load_into_hf(eng, device="cuda", dtype="float16")
    gen = np.array(tokens, dtype=np.int64).T  # [b, steps]
    ids = torch.tensor([prompts[i] + gen[i, :-1].tolist() for i in range(b)], device="cuda")
    with torch.no_grad():
        ref = hf(ids, attention_mask=torch.ones_like(ids)).logits[:, args.prompt_len - 1 :]
    ref = ref.float().cpu().numpy()
    diff = np.abs(ours - ref)
    agree = ours.argmax(-1) == ref.argmax(-1)  # [b, steps]
    top2 = np.sort(ref, axis=-1)[..., -2:]
    report = {
        "build": args.build,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "batch": b,
        "expert_major_from": eng.expert_major_from,
        "max_abs_diff": float(diff.max()),
        "median_step_max_abs_diff": float(np.median(diff.max(axis=-1))),
        "max_abs_logit": float(np.abs(ref).max()),
        "top1_agreement": float(np.mean(agree)),
        "first_disagreement": next((int(i) for i in np.flatnonzero(~agree[0])), None),
        "disagreements": [
            {"seq": int(i), "step": int(j), "hf_top2_margin": float(top2[i, j, 1] - top2[i, j, 0])}
            for i, j in zip(*np.nonzero(~agree), strict=True)
        ],
        "ours_s": t1 - t0,
        "hf_s": time.perf_counter() - t1,
        "gpu": torch.cuda.get_device_name(),
    }
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
