"""DeepSeek-V2 (236B)-shape numerics on the GPU: three layers at V2's real widths against HF.

The model is :data:`V2_SHAPED`: DeepSeek-V2's config (hidden 5120, 128 heads, q-LoRA of rank
1536, 160 routed experts of width 1536 and 2 shared, top-6 of group-limited routing over 8
groups keeping 3, scaled by 16, a dense first layer of width 12288, YaRN) cut to three layers:
the dense one and two MoE layers. Our float16 build of it creates its random weights on the GPU;
``dsv2_mlc.hf_export.load_into_hf`` copies the same weights into ``DeepseekV2ForCausalLM``
(float16, eager). We prefill a random prompt, decode ``--steps`` tokens greedily, run HF once
over prompt + our tokens (teacher forcing) and compare the logits that predicted each generated
token: max |difference| and top-1 agreement (the comparison of ``gpu_v2lite_numerics.py``),
one JSON report. About 9.3 G parameters: 19 GB of float16 for each model.

Here (with the TVM compiler), write the config and compile it::

    python scripts/gpu_v2_numerics.py --write-config V2_3L/config.json
    dsv2-mlc compile V2_3L/config.json --random-weights --device cuda --quantization q0f16 \\
        -o BUILD

On the GPU machine::

    python3 scripts/gpu_v2_numerics.py --build BUILD --lib-dir TVM_LIB --out $OUT/v2.json

``--batch 16`` decodes 16 sequences a step, which runs the expert-major MoE kernels. A
``q4f16_g128`` build of the config runs the INT4 kernels instead (HF gets the dequantised weights).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}

# DeepSeek-V2's config.json but for num_hidden_layers (1 dense + 2 MoE layers).
V2_SHAPED: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "attention_bias": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1536,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 160,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 128,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 3,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_scaling": YARN,
    "rope_theta": 10000,
    "routed_scaling_factor": 16.0,
    "scoring_func": "softmax",
    "tie_word_embeddings": False,
    "topk_group": 3,
    "topk_method": "group_limited_greedy",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 102400,
}


# what the report repeats from the build (that it is the V2 shape)
CHECKED_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "n_routed_experts",
    "moe_intermediate_size", "n_group", "topk_group", "topk_method",
)  # fmt: skip


def write_config(path: str | Path, layers: int = 3) -> Path:
    """Write :data:`V2_SHAPED` with ``layers`` layers (the first dense) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**V2_SHAPED, "num_hidden_layers": layers}, indent=1) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-config", default=None, help="write the config here and exit")
    ap.add_argument("--layers", type=int, default=3, help="with --write-config (first dense)")
    ap.add_argument("--build", default=None, help="our compiled build of the config")
    ap.add_argument("--lib-dir", default=None)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded in each step")
    ap.add_argument("--out", default="v2_numerics.json")
    args = ap.parse_args()
    if args.write_config:
        print(write_config(args.write_config, args.layers))
        return
    if args.build is None:
        ap.error("--build BUILD (or --write-config PATH)")

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_v2lite_numerics import (
        compare,
        greedy_logits,
        hf_forced_logits,
        open_engine,
        random_prompts,
    )

    from dsv2_mlc.hf_export import load_into_hf

    t0 = time.perf_counter()
    eng = open_engine(args.build, args.lib_dir, seed=args.seed, batch=args.batch,
                      prompt_len=args.prompt_len, steps=args.steps)  # fmt: skip
    prompts = random_prompts(args.seed, args.batch, args.prompt_len)
    ours, tokens = greedy_logits(eng, prompts, args.steps)
    t1 = time.perf_counter()
    free, total = torch.cuda.mem_get_info()

    hf = load_into_hf(eng, device="cuda", dtype="float16")
    ref = hf_forced_logits(hf, prompts, tokens)
    report = {
        "build": args.build,
        "model": {k: eng.build.model.get(k) for k in CHECKED_KEYS},
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "batch": args.batch,
        "expert_major_from": eng.expert_major_from,
        **compare(ours, ref),
        "ours_s": t1 - t0,
        "hf_s": time.perf_counter() - t1,
        "gpu_used_before_hf_gib": (total - free) / 2**30,  # our build, weights and KV cache
        "hf_torch_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gpu": torch.cuda.get_device_name(),
    }
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
