"""Held-out perplexity of the embedded default model with an FP8 (e4m3) KV cache vs the plain one.

A prefill's queries attend to the new tokens' fresh latents, so a one-call prefill never reads
the cache: the perplexity here is measured the way generation reads the cache, teacher-forced
token by token (the window's first token prefilled, every later one decoded, so every
prediction attends over the cached latents, its own token included). Builds (CPU): the
activation dtype's cache and ``--kv-dtype fp8``, for each ``--dtypes`` (q0f32, q0f16).

python scripts/eval_kv_fp8.py [--windows 48] [--window 512] [--dtypes float32,float16]
    [--kv-scale S]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from dsv2_mlc.compiler.compile import compile_model
from dsv2_mlc.evaluate import heldout_files, perplexity, token_windows
from dsv2_mlc.runtime.engine import Engine
from dsv2_mlc.runtime.tokenizer import Tokenizer

MODEL = Path(__file__).resolve().parent.parent / "dsv2_mlc" / "default_model"


def decode_logits(eng: Engine):  # -> (ids) -> [len(ids), vocab]
    """Logits of every position of ``ids``: the first token prefilled, the others decoded."""

    def fn(ids: list[int]) -> np.ndarray:
        seq = eng.add_sequence()
        try:
            out = [eng.prefill([seq], [ids[:1]])[0]]
            out += [eng.decode([seq], [t])[0] for t in ids[1:]]
        finally:
            eng.remove_sequence(seq)
        return np.stack(out)

    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--kv-scale", type=float, default=1.0, help="the FP8 cache's static scale")
    args = ap.parse_args()
    tok = Tokenizer.from_dir(MODEL)
    docs = [tok.encode(f.read_text(encoding="utf-8"), False) for f in heldout_files(MODEL)]
    windows = token_windows(docs, args.window, args.windows, tok.bos_token_id)
    report: dict = {"windows": len(windows), "window": args.window, "kv_scale": args.kv_scale}
    report["results"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            ppl = {}
            for kv in (None, "fp8"):
                t0 = time.perf_counter()
                name = f"{dtype}-{kv or 'plain'}"
                scale = args.kv_scale if kv else None
                build = compile_model(
                    MODEL, Path(tmp) / name, dtype=dtype, kv_dtype=kv, kv_scale=scale,
                    progress=False,
                ).out_dir  # fmt: skip
                eng = Engine(build, context_window=args.window)
                res = perplexity(decode_logits(eng), windows)
                ppl[kv or dtype] = res.ppl
                if kv is None:  # the one-call prefill (reads no cache), for reference
                    ppl[f"{dtype} prefill"] = perplexity(eng.logits, windows).ppl
                report["tokens"] = res.tokens
                print(f"{name}: ppl {res.ppl:.5f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            ppl["fp8 vs plain"] = ppl["fp8"] / ppl[dtype] - 1
            report["results"][dtype] = ppl
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
