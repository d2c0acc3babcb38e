"""Measure what INT4 quantization costs on the embedded default model (CPU): held-out perplexity,
greedy top-1 agreement with fp32 over 256 generated tokens, weight bytes per parameter and
compile time, for each quantization scheme. Prints a Markdown table (docs/quantization.md).

    python scripts/measure_quantization.py [--windows 24] [--out /tmp/dsv2-quant]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dsv2_mlc.compiler.compile import compile_model
from dsv2_mlc.evaluate import heldout_files, perplexity, token_windows, top1_agreement
from dsv2_mlc.runtime.engine import Engine
from dsv2_mlc.runtime.tokenizer import Tokenizer

MODEL = Path(__file__).resolve().parent.parent / "dsv2_mlc" / "default_model"
SCHEMES = [
    ("q0f32", {}),
    ("q4f32_g32", {}),
    ("q4f32_g128", {}),
    ("q4f32_g32", {"quantize_embedding": False, "quantize_lm_head": False}),
    ("q0f16", {}),
    ("q4f16_g32", {}),
    ("q4f16_g128", {}),
]


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
        label = name + ("" if not flags else " (embedding, lm_head in float)")
        t0 = time.perf_counter()
        out = Path(args.out) / (name + ("-float-ends" if flags else ""))
        compile_model(MODEL, out, quantization=name, progress=False, **flags)
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
