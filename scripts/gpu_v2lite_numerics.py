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

    python3 scripts/gpu_v2lite_numerics.py --build BUILD --lib-dir TVM_LIB --out $OUT/v2lite.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dsv2_mlc.runtime.engine import EXPERT_MAJOR_FROM, Engine


def open_engine(
    build: str,
    lib_dir: str | None,
    *,
    seed: int = 0,
    batch: int = 1,
    prompt_len: int = 128,
    steps: int = 64,
    expert_major_from: int | None = EXPERT_MAJOR_FROM,
) -> Engine:
    """The build with random weights ``seed``, sized for ``batch`` sequences of ``prompt_len +
    steps`` tokens, the prompts prefilled in one call (as ``bench`` runs them)."""
    context = max(1024, prompt_len + steps)
    return Engine(
        build,
        random_weights=seed,
        lib_dir=lib_dir,
        context_window=context,
        max_batch_size=batch,
        kv_capacity=context * batch,
        prefill_chunk_size=max(512, prompt_len * batch),
        expert_major_from=expert_major_from or None,
    )


def random_prompts(seed: int, batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` random ids below 100,000."""
    return np.random.default_rng(seed).integers(0, 100000, (batch, prompt_len)).tolist()


def greedy_logits(eng: Engine, prompts: list[list[int]], steps: int) -> tuple[np.ndarray, list]:
    """Prefill ``prompts`` as one batch, decode ``steps`` greedy steps; returns the logits that
    chose each token ``[b, steps, vocab]`` and the tokens ``[steps][b]``."""
    seqs = [eng.add_sequence() for _ in prompts]
    try:
        logits = [eng.prefill(seqs, prompts)]
        tokens: list[list[int]] = []
        for _ in range(steps):
            tokens.append([int(t) for t in np.argmax(logits[-1], axis=-1)])
            logits.append(eng.decode(seqs, tokens[-1]))
    finally:
        for seq in seqs:
            eng.remove_sequence(seq)
    return np.stack(logits[:steps], axis=1), tokens


def hf_forced_logits(hf, prompts: list[list[int]], tokens: list[list[int]]) -> np.ndarray:  # noqa: ANN001
    """HF's logits for prompt + our tokens (teacher forcing), at the positions that predicted
    each generated token: ``[b, steps, vocab]`` float32."""
    import torch

    gen = np.array(tokens, dtype=np.int64).T  # [b, steps]
    ids = [prompts[i] + gen[i, :-1].tolist() for i in range(len(prompts))]
    ids_t = torch.tensor(ids, device=hf.device)
    with torch.no_grad():
        ref = hf(ids_t, attention_mask=torch.ones_like(ids_t)).logits[:, len(prompts[0]) - 1 :]
    return ref.float().cpu().numpy()


def compare(ours: np.ndarray, ref: np.ndarray) -> dict:
    """Max |difference|, its median over steps, top-1 agreement and where it parts."""
    diff = np.abs(ours - ref)
    agree = ours.argmax(-1) == ref.argmax(-1)  # [b, steps]
    top2 = np.sort(ref, axis=-1)[..., -2:]
    return {
        "max_abs_diff": float(diff.max()),
        "median_step_max_abs_diff": float(np.median(diff.max(axis=-1))),
        "max_abs_logit": float(np.abs(ref).max()),
        "top1_agreement": float(np.mean(agree)),
        "first_disagreement": next((int(i) for i in np.flatnonzero(~agree[0])), None),
        "disagreements": [
            {"seq": int(i), "step": int(j), "hf_top2_margin": float(top2[i, j, 1] - top2[i, j, 0])}
            for i, j in zip(*np.nonzero(~agree), strict=True)
        ],
    }


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
    import torch

    from dsv2_mlc.hf_export import load_into_hf

    t0 = time.perf_counter()
    b = args.batch
    eng = open_engine(args.build, args.lib_dir, seed=args.seed, batch=b,
                      prompt_len=args.prompt_len, steps=args.steps,
                      expert_major_from=args.expert_major_from)  # fmt: skip
    prompts = random_prompts(args.seed, b, args.prompt_len)
    ours, tokens = greedy_logits(eng, prompts, args.steps)
    if args.save_logits:
        np.save(args.save_logits, ours)
    t1 = time.perf_counter()

    hf = load_into_hf(eng, device="cuda", dtype="float16")
    ref = hf_forced_logits(hf, prompts, tokens)
    report = {
        "build": args.build,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "batch": b,
        "expert_major_from": eng.expert_major_from,
        **compare(ours, ref),
        "ours_s": t1 - t0,
        "hf_s": time.perf_counter() - t1,
        "gpu": torch.cuda.get_device_name(),
    }
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
