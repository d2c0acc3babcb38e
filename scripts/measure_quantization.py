"""Measure what INT4 quantization costs on the embedded default model (CPU): held-out perplexity,
greedy top-1 agreement with fp32 over 256 generated tokens, weight bytes per parameter and
compile time, for each quantization scheme. Prints a Markdown table (docs/quantization.md).

    python scripts/measure_quantization.py [--windows 24] [--out /tmp/dsv2-quant]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from safetensors.numpy import load_file, save_file

from dsv2_mlc.compiler.compile import compile_model
from dsv2_mlc.evaluate import heldout_files, perplexity, token_windows, top1_agreement
from dsv2_mlc.quant import dequantize_int4, quantize_int4
from dsv2_mlc.runtime.engine import Engine
from dsv2_mlc.runtime.tokenizer import Tokenizer

MODEL = Path(__file__).resolve().parent.parent / "dsv2_mlc" / "default_model"
KV_B = "kv_b_proj"  # extra row: the absorbed MLA matrices in INT4 too (simulated)
SCHEMES = [
    ("q0f32", {}),
    ("q4f32_g32", {KV_B: True}),
    ("q4f32_g32", {}),
    ("q4f32_g128", {}),
    ("q4f32_g32", {"quantize_embedding": False, "quantize_lm_head": False}),
    ("q0f16", {}),
    ("q4f16_g32", {}),
    ("q4f16_g128", {}),
]


def with_int4_kv_b(model: Path, out: Path, group: int) -> Path:
    """A copy of ``model`` whose kv_b_proj (W_UK / W_UV) went through INT4 and back."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    tensors = load_file(model / "model.safetensors")
    for name, w in tensors.items():
        if name.endswith("kv_b_proj.weight"):
            tensors[name] = dequantize_int4(*quantize_int4(w, group, "float32"), group)
    save_file(tensors, out / "model.safetensors")
    return out


def weight_bytes(build_dir: Path) -> int:
    meta = json.loads((build_dir / "params" / "tensor-cache.json").read_text())
    return sum(rec["nbytes"] for shard in meta["records"] for rec in shard["records"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=24, help="held-out windows of 256 tokens")
    ap.add_argument("--out", default="/tmp/dsv2-quant", help="where the builds go")
    args = ap.parse_args()

    tok = Tokenizer.from_dir(MODEL)
    docs = [tok.encode(p.read_text(encoding="utf-8"), False) for p in heldout_files(MODEL)]
    windows = token_windows(docs, 256, args.windows, tok.bos_token_id)
    cfg = json.loads((MODEL / "config.json").read_text())
    n_params = None
    rows, reference = [], None
    for name, flags in SCHEMES:
        flags = dict(flags)
        kv_b = flags.pop(KV_B, False)
        label = name + (" + kv_b_proj INT4 (simulated)" if kv_b else "")
        label += " (embedding, lm_head in float)" if flags else ""
        source = with_int4_kv_b(MODEL, Path(args.out) / "kvb-src", 32) if kv_b else MODEL
        t0 = time.perf_counter()
        out = Path(args.out) / (name + ("-float-ends" if flags else "") + ("-kvb" if kv_b else ""))
        compile_model(source, out, quantization=name, progress=False, **flags)
        seconds = time.perf_counter() - t0
        eng = Engine(out, context_window=1024)
        if reference is None:
            reference = eng
            n_params = weight_bytes(out) // 4  # q0f32: 4 bytes per parameter
        ppl = perplexity(eng.logits, windows)
        gen = reference.generate(windows[0][:32], 256, stop_token_ids=[]).token_ids
        agree = top1_agreement(reference.logits, eng.logits, windows[0][:32] + gen)
        bits = 8 * weight_bytes(out) / n_params
        rows.append((label, ppl.ppl, agree, bits, seconds))
        print(
            f"{label}: ppl {ppl.ppl:.4f} ({ppl.tokens} tokens) top1 {agree:.4f} "
            f"bits/param {bits:.2f} compile {seconds:.1f}s",
            flush=True,
        )
    base = rows[0][1]
    print(
        f"\nmodel: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{n_params:,} parameters; {len(windows)} held-out windows of 256 tokens\n"
    )
    print(
        "| scheme | held-out ppl | vs q0f32 | top-1 agreement (288 tokens) | bits/param "
        "| compile s |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, ppl, agree, bits, seconds in rows:
        print(
            f"| {label} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% | {agree:.3f} | "
            f"{bits:.2f} | {seconds:.1f} |"
        )


if __name__ == "__main__":
    main()
