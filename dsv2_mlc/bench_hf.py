"""``dsv2-mlc bench --compare-hf``: transformers' ``DeepseekV2ForCausalLM`` on this model's
weights, timed as :mod:`dsv2_mlc.bench` times ours (see its module docstring, *hf*). Imported by
``bench`` only when asked for (transformers and torch are heavy)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def compare_hf(
    engine: Any,
    prompts: list[list[int]],
    opts: Any,
    our_first_logits: np.ndarray,
    ours: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Time transformers on this model's weights (see the module docstring). ``opts``: the
    bench's options (``BenchOptions``: its ``hf_*`` fields, ``batch`` and ``gen_len``)."""
    import torch

    from .hf_export import load_into_hf

    device = "cuda" if engine.device == "cuda" else "cpu"

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    model = load_into_hf(
        engine, device=device, dtype=opts.hf_dtype, attn_implementation=opts.hf_attn
    )
    load_s = time.perf_counter() - t0
    log(f"HF model ({opts.hf_dtype}, {opts.hf_attn}) built and filled in {load_s:.1f} s")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ids = torch.tensor(prompts, device=device)

    def run(
        model: Any, tokens: torch.Tensor, n_decode: int
    ) -> tuple[float, list[float], torch.Tensor]:
        mask = torch.ones_like(tokens)
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=tokens, attention_mask=mask, use_cache=True)
        sync()
        prefill = time.perf_counter() - t0
        logits, cache, steps = out.logits[:, -1], out.past_key_values, []
        nxt = logits.argmax(-1, keepdim=True)
        for _ in range(n_decode):
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            s0 = time.perf_counter()
            out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            steps.append(time.perf_counter() - s0)
            cache = out.past_key_values
        return prefill, steps, logits

    with torch.no_grad():
        run(model, ids[:, : min(16, ids.shape[1])], 2)  # warm-up
        prefill_s, steps, logits = run(model, ids, min(opts.hf_decode_tokens, opts.gen_len))
    hf_first = logits[0].float().cpu().numpy()
    decode_tok_s = opts.batch * len(steps) / sum(steps)
    prefill_tok_s = ids.numel() / prefill_s
    result = {
        "dtype": opts.hf_dtype,
        "attn_implementation": opts.hf_attn,
        "load_s": load_s,
        "prefill_s": prefill_s,
        "prefill_tok_s": prefill_tok_s,
        "decode_steps": len(steps),
        "step_s": steps,
        "decode_tok_s": decode_tok_s,
        "tpot_ms_p50": float(np.percentile(steps, 50)) * 1e3,
        "peak_torch_allocated_bytes": (
            torch.cuda.max_memory_allocated() if device == "cuda" else None
        ),
        "first_logits_max_abs_diff": float(np.abs(hf_first - our_first_logits).max()),
        "first_logits_max_abs": float(np.abs(hf_first).max()),
        "first_token_agrees": bool(hf_first.argmax() == our_first_logits.argmax()),
        "ratio_prefill_tok_s": ours["prefill"]["prefill_tok_s"] / prefill_tok_s,
        "ratio_decode_tok_s": (ours["decode"]["decode_tok_s"] or 0.0) / decode_tok_s,
    }
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result
