"""End to end on CPU in float16 (``q0f16``): our compiled model against HF transformers run in
float32 on the same float16 weights, so that what differs is our float16 arithmetic alone.

The tolerance, derived: a ``q0f16`` build stores every activation between kernels in float16,
each store a rounding with relative error at most ``u = 2**-11`` (round to nearest, 11-bit
significand). Along the path from the embedding to the logits there are about ``R = 40`` such
stores (per layer: the input norm, the q / latent projections, the attention's query, scores and
output, o_proj, the residual add, the post-attention norm, the experts' gate/up, SiLU * up, down
and their weighted sum, the residual add - 3 layers - then the final norm and the LM head). With
RMSNorm in every layer the network does not amplify a relative error (condition ~1), so the
errors add up to at most ``R * u`` ~ 2e-2 relative to the logits (L2), and a logit moves by at
most ``R * u * max|logit|``; independent roundings give ~``sqrt(R) * u`` ~ 3e-3, which is what
the build shows (relative L2 ~3.7e-3, max |diff| ~0.02 on logits up to ~3.6; HF's own float16
run is 5e-3 from its float32 one). A bug - a wrong RoPE, a dropped expert, a bad scale - moves
the logits by O(0.1 - 1) relative and fails the bound. The lower bound (relative L2 above 1e-4,
where a float32 build sits at ~1e-6) checks that the build does compute in float16.

Routing: a MoE router's top-k is a discontinuity, and a decision closer than float16 resolution
may go either way (docs/gpu-numerics.md). The checkpoint's seed (1237) is one whose HF routing of
the prompt and its greedy continuation has no decision closer than 1.5e-3; the test checks it.

Greedy tokens: float16 noise may swap two tokens whose logits are closer than twice the error,
so the tokens must equal HF's up to the first step where they differ, and that step (if any)
must be one HF's top-2 margin cannot decide (margin < 2 x our error there).
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import (
    CONFIG_A,
    PROMPT,
    hf_greedy,
    hf_logits,
    load_hf,
    make_checkpoint,
    routing_margin,
)

U = 2.0**-11  # float16 unit roundoff
ROUNDINGS = 40  # float16 stores along the path to the logits (module docstring)
REL_L2_TOL = ROUNDINGS * U  # ~1.95e-2
FP16_FLOOR = 1e-4  # a float32 build sits at ~1e-6
SEED = 1237  # routing margin >= MIN_ROUTING_MARGIN over the prompt and 32 greedy tokens
MIN_ROUTING_MARGIN = 1.5e-3
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def fp16(tmp_path_factory: pytest.TempPathFactory):
    """(Engine of the q0f16 build, HF float32 on the float16-rounded weights)."""
    from dsv2_mlc.compiler.compile import compile_model
    from dsv2_mlc.runtime.engine import Engine

    root = tmp_path_factory.mktemp("fp16")
    ckpt = make_checkpoint(root / "ckpt", CONFIG_A, seed=SEED)
    out = compile_model(ckpt, root / "q0f16", quantization="q0f16", progress=False).out_dir
    hf = load_hf(ckpt).half().float()  # the weights our build holds, computed in float32
    return Engine(out, context_window=128), hf


def _rel_l2(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def test_checkpoint_routes_clear_of_fp16_resolution(fp16):
    _, hf = fp16
    tokens = hf_greedy(hf, PROMPT, NEW_TOKENS)
    assert routing_margin(hf, PROMPT + tokens) >= MIN_ROUTING_MARGIN


def test_fp16_prefill_logits_match_hf_within_fp16_rounding(fp16):
    eng, hf = fp16
    ours, ref = eng.logits(PROMPT), hf_logits(hf, PROMPT)
    assert ours.shape == ref.shape
    assert FP16_FLOOR < _rel_l2(ours, ref) < REL_L2_TOL
    assert np.abs(ours - ref).max() < REL_L2_TOL * np.abs(ref).max()


def test_fp16_greedy_tokens_match_hf_where_fp16_can_decide(fp16):
    eng, hf = fp16
    ref_tokens = hf_greedy(hf, PROMPT, NEW_TOKENS)
    ours = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_token_ids=[]).token_ids
    # teacher-forced logits over HF's continuation: our error and HF's margin at each step
    ref = hf_logits(hf, PROMPT + ref_tokens)
    forced = eng.logits(PROMPT + ref_tokens)
    steps = slice(len(PROMPT) - 1, len(PROMPT) - 1 + NEW_TOKENS)
    assert _rel_l2(forced[steps], ref[steps]) < REL_L2_TOL
    error = np.abs(forced - ref)[steps].max(-1)
    top2 = np.sort(ref[steps], -1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 2 * error
    np.testing.assert_array_equal(forced[steps].argmax(-1)[decided], np.array(ref_tokens)[decided])
    assert len(ours) == NEW_TOKENS
    pairs = enumerate(zip(ours, ref_tokens, strict=True))
    same = next((i for i, (a, b) in pairs if a != b), NEW_TOKENS)
    assert same == NEW_TOKENS or not decided[same], (same, ours, ref_tokens)
    assert same >= NEW_TOKENS // 2, (ours, ref_tokens)  # not a vacuous comparison
