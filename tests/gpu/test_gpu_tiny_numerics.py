"""The tiny configs' CUDA builds against HF transformers float32 on the same random weights.

For each build of ``gpu_lane.TINY_BUILDS``: HF float32 (CPU) is filled with the build's random
weights (``load_into_hf``; INT4 dequantised, so the comparison measures the kernels, not the
quantization), the seed chosen so that no routing decision is a near tie; then
scripts/gpu_numerics.py's measurements: prefill logits of every prompt position, the same
prefilled in chunks of 5, teacher-forced decode at batch 1 and in batches of 4 sequences at
different positions, and 32 free-running greedy tokens. Bounds from docs/gpu-numerics.md's runs
(max |error| up to 4.7e-2 in fp16 and 1.4e-5 in float32 at logits up to ~4.4, relative L2 below
5e-3 and 1e-6, every greedy token equal).
"""

from __future__ import annotations

import numpy as np
import pytest
from lane_helpers import (
    NEW_TOKENS,
    PROMPT,
    lane,
    lane_build,
    numerics,
    refs_script,
    well_routed_reference,
)

pytestmark = pytest.mark.gpu

# dtype -> (max |error| as a fraction of the largest |reference logit|, relative L2)
BOUNDS = {"float16": (0.03, 1e-2), "float32": (5e-5, 1e-5)}
CASES = ("prefill", "chunked", "forced", "forced_batch")


@pytest.mark.parametrize("tag", [t for t, _, _ in lane.TINY_BUILDS])
def test_tiny_build_matches_hf_float32(tag, manifest, lib_dir, tmp_path):
    build = lane_build(manifest, tag)
    ref = well_routed_reference(build.path, lib_dir)
    refs = tmp_path / "refs"
    refs_script.save_refs(ref.model, refs)
    res = numerics.check_build(build.path, refs, PROMPT, NEW_TOKENS, lib_dir, ref.seed)
    frac, rel_l2 = BOUNDS[build.dtype]
    where = f"{tag}, random weights seed {ref.seed} (routing margin {ref.margin:.1e})"
    for case in CASES:
        r = res[case]
        bound = frac * r["max_abs_ref"]
        assert r["finite"], f"{where}: {case} logits not finite"
        assert r["max_abs"] <= bound, f"{where}: {case} max |error| {r['max_abs']:.3e}"
        assert r["rel_l2"] <= rel_l2, f"{where}: {case} relative L2 {r['rel_l2']:.2e}"
        # an arg-max may only differ where HF's own top two are within twice the error bound
        assert r["argmax_differs_ref_margin"] <= 2 * bound, f"{where}: {case} {r}"
    greedy = res["greedy"]
    assert greedy["of"] == NEW_TOKENS
    if greedy["first_divergence"] is not None:  # only at a near tie of HF's own logits
        step = greedy["first_divergence"]
        row = np.load(refs / "forced_logits.npy")[len(PROMPT) - 1 + step]
        top2 = np.sort(row)[-2:]
        bound = BOUNDS[build.dtype][0] * res["forced"]["max_abs_ref"]
        assert top2[1] - top2[0] <= 2 * bound, (
            f"{where}: greedy tokens part from HF at step {step} where HF's top two are "
            f"{top2[1] - top2[0]:.3f} apart: {greedy['tokens']} vs {greedy['reference']}"
        )
