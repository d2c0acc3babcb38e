"""Numerical study: which FP8 latent-cache layout keeps the default model's held-out perplexity
within +0.5 % of the unrounded cache (schedules/results/kv_fp8.md).

HF's ``DeepseekV2ForCausalLM`` caches ``[RMSNorm(c_kv)]`` and ``rope(k_pe)`` through
``Cache.update(latent, k_pe)``; a cache that returns both rounded as a layout stores them makes a
one-call forward compute exactly what token-by-token decoding over that cache computes (every
query attends over the rounded rows, its own included). Each layout is a pair of rounding
functions (latent, rope); the perplexity runs over the same held-out windows as
scripts/eval_kv_fp8.py.

python schedules/lab/kv_fp8_layouts.py [--windows 48] [--window 512]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from transformers import DeepseekV2ForCausalLM, DynamicCache

from dsv2_mlc.evaluate import heldout_files, perplexity, token_windows
from dsv2_mlc.runtime.tokenizer import Tokenizer

MODEL = Path(__file__).resolve().parents[2] / "dsv2_mlc" / "default_model"
Round = Callable[[np.ndarray], np.ndarray]


def ident(x: np.ndarray) -> np.ndarray:
    return x


def cast(dtype) -> Round:  # noqa: ANN001
    def f(x: np.ndarray) -> np.ndarray:
        return x.astype(dtype).astype(np.float32)

    return f


def e4m3(scale: float = 1.0) -> Round:
    def f(x: np.ndarray) -> np.ndarray:
        a = (x / np.float32(scale)).clip(-448, 448)
        return a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(scale)

    return f


def e4m3_group(group: int, scale_dtype=np.float32) -> Round:  # noqa: ANN001
    """e4m3 with one scale per ``group`` consecutive values of a row: amax / 448."""

    def f(x: np.ndarray) -> np.ndarray:
        shp = x.shape
        g = x.reshape(*shp[:-1], shp[-1] // group, group)
        s = np.abs(g).max(-1, keepdims=True) / np.float32(448)
        s = np.where(s == 0, np.float32(1), s).astype(scale_dtype).astype(np.float32)
        q = (g / s).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
        return q.reshape(shp)

    return f


def rounding_cache(lat: Round, rope: Round) -> DynamicCache:
    class C(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # noqa: ANN001
            k = torch.from_numpy(lat(key_states.detach().float().numpy()))
            v = torch.from_numpy(rope(value_states.detach().float().numpy()))
            return super().update(k, v, layer_idx, *args, **kwargs)

    return C()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(MODEL)
    docs = [tok.encode(f.read_text(encoding="utf-8"), False) for f in heldout_files(MODEL)]
    windows = token_windows(docs, args.window, args.windows, tok.bos_token_id)
    model = DeepseekV2ForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    cfg = model.config
    L, R, n_layers = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_hidden_layers

    # the latent's value distribution (what e4m3's range and subnormals see)
    seen: dict[str, list[np.ndarray]] = {"latent": [], "rope": []}

    def record(x: np.ndarray, key: str) -> np.ndarray:
        seen[key].append(x.ravel().copy())
        return x

    with torch.no_grad():
        for w in windows[:8]:
            cache = rounding_cache(lambda x: record(x, "latent"), lambda x: record(x, "rope"))
            model(torch.tensor([w]), past_key_values=cache, use_cache=True)
    dist = {}
    for key, xs in seen.items():
        a = np.abs(np.concatenate(xs))
        dist[key] = {
            "absmax": float(a.max()),
            "p50": float(np.median(a)),
            "p99": float(np.quantile(a, 0.99)),
            "frac_below_2^-6": float((a < 2**-6).mean()),
            "frac_below_2^-3": float((a < 2**-3).mean()),
        }
    print(json.dumps({"distribution": dist}, indent=1), flush=True)

    # (name, latent rounding, rope rounding, bytes per token and layer at (L, R), build dtype f32)
    f16, bf16 = cast(np.float16), cast(ml_dtypes.bfloat16)
    layouts = [
        ("float32 (plain)", ident, ident, 4 * (L + R)),
        ("e4m3 all, scale 1 (current)", e4m3(), e4m3(), L + R),
        ("e4m3 latent, rope float32", e4m3(), ident, L + 4 * R),
        ("e4m3 latent, rope float16", e4m3(), f16, L + 2 * R),
        ("e4m3 latent, rope bfloat16", e4m3(), bf16, L + 2 * R),
        ("e4m3 latent per-token scale, rope float16", e4m3_group(L), f16, L + 4 + 2 * R),
        ("e4m3 latent + rope, per-token scales", e4m3_group(L), e4m3_group(R), L + R + 8),
        ("float16 latent, e4m3 rope", f16, e4m3(), 2 * L + R),
        ("float16 all", f16, f16, 2 * (L + R)),
    ]
    results = []
    for name, lat, rope, nbytes in layouts:

        def logits(ids: list[int], lat=lat, rope=rope) -> np.ndarray:
            with torch.no_grad():
                out = model(torch.tensor([ids]), past_key_values=rounding_cache(lat, rope),
                            use_cache=True)  # fmt: skip
            return out.logits[0].float().numpy()

        res = perplexity(logits, windows)
        results.append({"layout": name, "ppl": res.ppl, "bytes_per_token_layer": nbytes})
        base = results[0]["ppl"]
        print(f"{name:48s} ppl {res.ppl:.4f} ({100 * (res.ppl / base - 1):+.3f} %) "
              f"{nbytes} B/token/layer", flush=True)  # fmt: skip
    print(json.dumps({"L": L, "R": R, "layers": n_layers, "results": results}, indent=1))


if __name__ == "__main__":
    main()
