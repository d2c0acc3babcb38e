"""A tiny model compiled with ``--kv-dtype fp8`` (CPU, float32) against HF transformers whose
latent cache goes through the same e4m3 rounding, and the FP8 build's options and sizes.

The reference is HF's ``DeepseekV2ForCausalLM`` (which caches ``RMSNorm(c_kv)`` and
``rope(k_pe)`` through ``Cache.update(latent, k_pe)``) with a cache that stores each latent value
as ``e4m3(x / kv_scale) * kv_scale`` (``ml_dtypes``) and the rope part unrounded (the build's
float32), as the FP8 cache does, and attends like ours:
a prefill's queries see the new tokens unrounded (our self-attention runs on the fresh
latents), every decode step sees the rounded cache, its own token included (the append runs
before the attention). So the two sides differ by float32 rounding only, except where that
moves a value across an e4m3 rounding boundary; the stated logit tolerance covers that.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_reference import CONFIGS, PROMPT, load_hf, make_checkpoint  # noqa: E402

KV_SCALE = 0.5
STEPS = 32
# float32 rounding differences can flip a latent value to the neighbouring e4m3 value (a relative
# step of 2^-3): the logits stay within this of the reference (their magnitude is ~4)
LOGIT_TOL = 2e-2


def fake_e4m3(x: torch.Tensor, kv_scale: float) -> torch.Tensor:
    """``e4m3(x / kv_scale) * kv_scale`` in float32 (saturated at +-448)."""
    a = (x.detach().float().numpy() / np.float32(kv_scale)).clip(-448, 448)
    q = a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(kv_scale)
    return torch.from_numpy(q)


def fp8_cache(kv_scale: float, round_rope: bool = False):
    """An HF ``DynamicCache`` that stores the latents (``key_states``) e4m3-rounded, the rope
    part (``value_states``) unrounded unless ``round_rope`` (a control), and returns the new
    tokens of a prefill (more than one) unrounded."""
    from transformers import DynamicCache

    class FP8LatentCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k8 = fake_e4m3(key_states, kv_scale)
            v8 = fake_e4m3(value_states, kv_scale) if round_rope else value_states
            keys, values = super().update(k8, v8, layer_idx, *args, **kwargs)
            n = key_states.shape[-2]
            if n > 1:  # prefill: the new tokens unrounded, the cached ones rounded
                keys = torch.cat([keys[..., :-n, :], key_states], dim=-2)
                values = torch.cat([values[..., :-n, :], value_states], dim=-2)
            return keys, values

    return FP8LatentCache()


def hf_fp8_run(model, prompt: list[int], n: int, kv_scale: float, round_rope: bool = False):
    """Greedy tokens and the logits of each step (the prompt's last, then each decode)."""
    cache = fp8_cache(kv_scale, round_rope)
    tokens, logits = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
        for _ in range(n):
            step = out.logits[0, -1].float().numpy()
            logits.append(step)
            tokens.append(int(step.argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
    return tokens, np.stack(logits)


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    from dsv2_mlc.compiler.compile import compile_model
    from dsv2_mlc.runtime.engine import Engine

    root = tmp_path_factory.mktemp("fp8kv")
    out = {}
    for name in ("A", "B"):
        ckpt = make_checkpoint(root / f"ckpt{name}", CONFIGS[name])
        build = compile_model(
            ckpt, root / f"fp8{name}", progress=False, kv_dtype="fp8", kv_scale=KV_SCALE
        )
        out[name] = (Engine(build.out_dir, context_window=256, max_batch_size=4), load_hf(ckpt))
    return out


@pytest.mark.parametrize("name", ["A", "B"])
def test_fp8_greedy_and_logits_match_hf_with_fp8_cache(fp8_models, name: str) -> None:
    eng, hf = fp8_models[name]
    ref_tokens, ref_logits = hf_fp8_run(hf, PROMPT, STEPS, KV_SCALE)
    ours = eng.generate(PROMPT, max_new_tokens=STEPS, stop_token_ids=[])
    assert ours.token_ids == ref_tokens
    seq = eng.add_sequence()
    try:
        steps = [eng.prefill([seq], [PROMPT])[0]]
        for tok in ref_tokens[:-1]:
            steps.append(eng.decode([seq], [tok])[0])
    finally:
        eng.remove_sequence(seq)
    assert np.abs(np.stack(steps) - ref_logits).max() < LOGIT_TOL


def test_fp8_reference_differs_from_unrounded(fp8_models) -> None:
    """Control: the e4m3 rounding is visible at this tolerance (HF with its plain cache)."""
    eng, hf = fp8_models["A"]
    _, ref_logits = hf_fp8_run(hf, PROMPT, 8, KV_SCALE)
    with torch.no_grad():
        plain = hf(torch.tensor([PROMPT + [int(ref_logits[0].argmax())]])).logits[0, -1].numpy()
    assert np.abs(plain - ref_logits[1]).max() > LOGIT_TOL


def test_fp8_rope_part_is_not_rounded(fp8_models) -> None:
    """Control: a reference that rounds the rope part to e4m3 too (every value one byte) is
    further from ours than the tolerance, so the parity test sees the rope part's format."""
    eng, hf = fp8_models["A"]
    tokens, ref_logits = hf_fp8_run(hf, PROMPT, 8, KV_SCALE, round_rope=True)
    seq = eng.add_sequence()
    try:
        steps = [eng.prefill([seq], [PROMPT])[0]]
        steps += [eng.decode([seq], [t])[0] for t in tokens[:-1]]
    finally:
        eng.remove_sequence(seq)
    assert np.abs(np.stack(steps) - ref_logits).max() > LOGIT_TOL


def _decode_after(eng, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """A fresh sequence's decode logits of each of ``tokens`` after prefilling ``prompt``."""
    seq = eng.add_sequence()
    try:
        eng.prefill([seq], [prompt])
        return np.stack([eng.decode([seq], [t])[0] for t in tokens])
    finally:
        eng.remove_sequence(seq)


def test_fp8_fork_and_popn_reproduce_decode(fp8_models) -> None:
    """A forked sequence (the pages it shares, its partial page copied) and a sequence popped
    back decode exactly as a fresh sequence with the same history."""
    eng, _ = fp8_models["A"]
    want = _decode_after(eng, PROMPT, [5, 6, 7, 9])
    seq = eng.add_sequence()
    try:
        eng.prefill([seq], [PROMPT])
        for t in (5, 6, 7):
            eng.decode([seq], [t])
        child = eng.fork_sequence(seq)
        np.testing.assert_allclose(eng.decode([child], [9])[0], want[3], atol=1e-5)
        eng.remove_sequence(child)
        eng.popn(seq, 3)
        again = np.stack([eng.decode([seq], [t])[0] for t in (5, 6, 7, 9)])
        np.testing.assert_allclose(again, want, atol=1e-5)
    finally:
        eng.remove_sequence(seq)


def test_fp8_chunked_prefill_reads_the_cache(fp8_models) -> None:
    """A prompt prefilled in two chunks: the second chunk's queries see the first chunk through
    the FP8 cache, so its last logits match the HF reference that rounds the first chunk's
    latents (and not the one-chunk prefill)."""
    eng, hf = fp8_models["A"]
    first, second = PROMPT[:5], PROMPT[5:]
    seq = eng.add_sequence()
    try:
        eng.prefill([seq], [first])
        got = eng.prefill([seq], [second])[0]
    finally:
        eng.remove_sequence(seq)
    cache = fp8_cache(KV_SCALE)
    with torch.no_grad():
        hf(torch.tensor([first]), cache=cache, use_cache=True)
        ref = hf(torch.tensor([second]), cache=cache, use_cache=True).logits[0, -1]
    assert np.abs(got - ref.numpy()).max() < LOGIT_TOL


def test_fp8_build_records_its_cache_bytes(fp8_models) -> None:
    from dsv2_mlc.layout import BuildConfig

    eng, _ = fp8_models["A"]
    build = BuildConfig.read(eng.path)
    assert build.kv_dtype == "float8_e4m3fn" and build.kv_scale == KV_SCALE
    assert build.cache_dtype == "float8_e4m3fn" and build.dtype == "float32"
    plain = BuildConfig(**{**build.to_dict(), "kv_dtype": "", "kv_scale": 1.0})
    cfg = CONFIGS["A"]
    lora, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    # one byte a latent value, the rope part in float32
    assert build.kv_bytes_per_token() == cfg["num_hidden_layers"] * (lora + 4 * rope)
    assert plain.kv_bytes_per_token() == cfg["num_hidden_layers"] * 4 * (lora + rope)


def test_v2_lite_fp8_cache_bytes() -> None:
    from dsv2_mlc.layout import BuildConfig

    model = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_hidden_layers": 27}
    f16 = BuildConfig(1, model, "float16", "cuda", "")
    f8 = BuildConfig(1, model, "float16", "cuda", "", kv_dtype="float8_e4m3fn")
    assert f16.kv_bytes_per_token() == 27 * 576 * 2
    assert f8.kv_bytes_per_token() == 27 * (512 + 64 * 2)  # 640 B a token and layer


@pytest.mark.parametrize(
    ("kv_dtype", "kv_scale", "match"),
    [("fp4", None, "unsupported --kv-dtype"), ("float16", None, "unsupported --kv-dtype"),
     ("fp8", 0.0, "--kv-scale"), (None, 2.0, "fp8 only")],
)  # fmt: skip
def test_bad_kv_dtype_is_a_clear_error(tmp_path, kv_dtype, kv_scale, match) -> None:
    import json

    from dsv2_mlc.compiler.compile import CompileError, compile_random_model
    from dsv2_mlc.errors import Dsv2Error

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIGS["A"]))
    with pytest.raises(CompileError, match=match) as err:
        compile_random_model(cfg, tmp_path / "out", kv_dtype=kv_dtype, kv_scale=kv_scale)
    assert isinstance(err.value, Dsv2Error)
    assert not (tmp_path / "out").exists()


def test_resolve_keys_builds_by_kv_dtype(fp8_models, tmp_path) -> None:
    """A cached build of another KV dtype is not reused: the key and entry name differ; a
    compiled folder of another KV dtype is refused with the fix named."""
    from dsv2_mlc.resolve import ModelNotFoundError, cache_key, resolve_model

    eng, _ = fp8_models["A"]
    ckpt = make_checkpoint(tmp_path / "ckpt", CONFIGS["A"])
    keys = {
        kv: cache_key(ckpt, dtype=None, device="cpu", cache_dir=tmp_path, kv_dtype=kv)
        for kv in (None, "float32", "fp8", "float8_e4m3fn")
    }
    assert keys[None] == keys["float32"] == cache_key(ckpt, dtype=None, device="cpu",
                                                      cache_dir=tmp_path)  # fmt: skip
    assert keys["fp8"] == keys["float8_e4m3fn"] != keys[None]
    assert resolve_model(eng.path, kv_dtype="fp8") == eng.path
    with pytest.raises(ModelNotFoundError, match="kv-dtype"):
        resolve_model(eng.path, kv_dtype="float32")
    with pytest.raises(ModelNotFoundError, match="unsupported kv_dtype"):
        resolve_model(eng.path, kv_dtype="int8")
