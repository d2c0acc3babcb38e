"""Held-out perplexity of the embedded default model: our compiled module (q0f32, CPU) vs HF fp32.

python scripts/eval_default_model.py [--windows 48] [--window 512]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from dsv2_mlc.compiler.compile import compile_model
from dsv2_mlc.evaluate import heldout_files, perplexity, token_windows
from dsv2_mlc.runtime.engine import Engine
from dsv2_mlc.runtime.tokenizer import Tokenizer

MODEL = Path(__file__).resolve().parent.parent / "dsv2_mlc" / "default_model"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    tok = Tokenizer.from_dir(MODEL)
    docs = [tok.encode(f.read_text(encoding="utf-8"), False) for f in heldout_files(MODEL)]
    windows = token_windows(docs, args.window, args.windows, tok.bos_token_id)
    with tempfile.TemporaryDirectory() as tmp:
        build = compile_model(MODEL, Path(tmp) / "q0f32", progress=False).out_dir
        ours = perplexity(Engine(build, context_window=args.window).logits, windows)
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()

    def hf_logits(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0].numpy()

    ref = perplexity(hf_logits, windows)
    print(f"{len(windows)} windows of {args.window} tokens ({ours.tokens} predicted tokens)")
    print(
        f"ours (q0f32, CPU): ppl {ours.ppl:.4f}; HF fp32: ppl {ref.ppl:.4f}; "
        f"ratio {ours.ppl / ref.ppl - 1:+.5%}"
    )


if __name__ == "__main__":
    main()
