"""The MoE decode kernels at DeepSeek-V2 (236B) widths, run on the CPU against float64 NumPy.

V2's MoE layer: hidden 5120 (160 chunks of 32: five a lane), routed experts of width 1536 (48
chunks; 12 runs of 128, an even number: runs of 256 with no tail), two shared experts (3072),
top-6 of group-limited routing (8 groups, the best 3), scaled by 16, INT4 groups of 128. These
cases run the shipped tiles (``schedules/tiles.py``) at those widths; the expert-major kernels
stage rows of 5120 inputs in dynamic shared memory, a path V2-Lite's 2048 never takes. Only the
number of experts is cut (24 of 160, 3 a group, so the group limit still leaves 9 candidates for
6 slots): the weights of 160 experts at these widths are 1.9 GB, and the router at 160 experts
is emulated on its own (``tests/test_moe_decode_emulation.py``). One token each: a few minutes
of emulation already; several tokens, experts shared between them and the batch plans are
covered at small widths by the other MoE emulation tests.

Weights are drawn packed and dequantised one expert at a time where a token uses it, so the float64
reference never holds a whole layer. Reference and tolerances as in
``tests/test_moe_decode_emulation.py`` and ``tests/test_moe_expert_mma_emulation.py``; every
output starts NaN.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.moe_decode_cuda import (
    MoeDecodeShape,
    down_decode_kernel,
    gate_up_decode_kernel,
)
from dsv2_mlc.schedules.moe_expert_mma_cuda import (
    down_expert_mma_kernel,
    expert_mma_unsupported,
    gate_up_expert_mma_kernel,
)
from dsv2_mlc.schedules.tiles import tuned

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain, rel_l2  # noqa: E402
from test_moe_decode_emulation import TOL, route_numpy  # noqa: E402

pytestmark = [needs_toolchain, pytest.mark.wide]  # minutes of emulation: pytest -m wide

# V2's widths and routing, 24 experts instead of 160 (module docstring)
V2_WIDTHS = MoeDecodeShape(5120, 1536, 3072, 24, 6, 128, 8, 3, False, 16.0)


def _dequant(packed: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """float64 values of an INT4 group weight (the layout of ``cuda_emulation.random_int4``)."""
    k = packed.shape[-1] * 8
    q = np.empty((*packed.shape[:-1], k), np.float64)
    for i in range(8):
        q[..., i::8] = (packed >> np.uint32(4 * i)) & np.uint32(15)
    return (q - 8) * np.repeat(scale.astype(np.float64), group, axis=-1)[..., :k]


def _packed(rng: np.random.Generator, rows: tuple[int, ...], k: int, group: int) -> tuple:
    """(packed, scales) of a random INT4 group weight ``[*rows, k]`` in the layout and scale
    range of :func:`random_int4`, without its float64 values (uniform random words are uniform
    nibbles)."""
    packed = rng.integers(0, 2**32, (*rows, k // 8), dtype=np.uint32)
    scale = rng.uniform(0.5, 1.5, (*rows, -(-k // group))) / (4.6 * np.sqrt(k))
    return packed, scale.astype(np.float16)


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


class _Layer:
    """Random inputs of one MoE layer of shape ``s`` for ``n`` tokens, and float64 references
    that dequantise one expert at a time (:func:`_dequant`)."""

    def __init__(self, s: MoeDecodeShape, n: int, seed: int):
        rng = np.random.default_rng(seed)
        H, NI, IS, E, G = s.hidden, s.inter, s.shared_inter, s.experts, s.group
        self.s = s
        self.x = rng.standard_normal((n, H)).astype(np.float16)
        self.logits = (2 * rng.standard_normal((n, E))).astype(np.float32)
        self.w, self.sc = _packed(rng, (E, 2 * NI), H, G)
        self.sw, self.ss = _packed(rng, (2 * IS,), H, G)
        self.dw, self.ds = _packed(rng, (E, H), NI, G)
        self.sdw, self.sds = _packed(rng, (H,), IS, G)
        args = (s.top_k, s.n_group, s.topk_group, s.norm_topk_prob, s.routed_scaling_factor)
        self.ref_w, self.ref_ids = route_numpy(self.logits.astype(np.float64), *args)

    def ref_h(self) -> np.ndarray:
        """``[n, K I + Is]``: each slot's ``silu(gate . x) * (up . x)``, then the shared one."""
        s, xf = self.s, self.x.astype(np.float64)
        NI, IS, K = s.inter, s.shared_inter, s.top_k
        h = np.full((xf.shape[0], s.total), np.nan)
        for e in np.unique(self.ref_ids):
            wv = _dequant(self.w[e], self.sc[e], s.group)
            for t, j in zip(*np.nonzero(self.ref_ids == e), strict=True):
                gu = wv @ xf[t]
                h[t, j * NI : (j + 1) * NI] = _silu(gu[:NI]) * gu[NI:]
        gu = xf @ _dequant(self.sw, self.ss, s.group).T
        h[:, K * NI :] = _silu(gu[:, :IS]) * gu[:, IS:]
        return h

    def ref_down(self, h: np.ndarray) -> np.ndarray:
        """``[n, K + 1, H]``: each slot's ``down . h_j`` unweighted, then the shared experts'."""
        s, hf = self.s, h.astype(np.float64)
        NI, K = s.inter, s.top_k
        out = np.full((hf.shape[0], K + 1, s.hidden), np.nan)
        for e in np.unique(self.ref_ids):
            dv = _dequant(self.dw[e], self.ds[e], s.group)
            for t, j in zip(*np.nonzero(self.ref_ids == e), strict=True):
                out[t, j] = dv @ hf[t, j * NI : (j + 1) * NI]
        out[:, K] = hf[:, K * NI :] @ _dequant(self.sdw, self.sds, s.group).T
        return out


def test_token_major_kernels_at_v2_widths(tmp_path: Path) -> None:
    """The batch-1 decode pair (routing + gate/up + SwiGLU, then down + weighted sum) with the
    shipped tiles at V2's widths, group-limited routing inside the first kernel."""
    s, n = V2_WIDTHS, 1
    assert s.unsupported() is None
    layer = _Layer(s, n, seed=11)
    gu = tuned("moe_decode_gate_up", shape=(s.hidden,))
    dn = tuned("moe_decode_down", shape=(s.hidden,))

    h = np.full((n, s.total), np.nan, np.float16)
    weights = np.full((n, s.top_k), np.nan, np.float32)
    ids = np.full((n, s.top_k), -1, np.int32)
    arrays = {"x": layer.x, "logits": layer.logits, "w": layer.w, "sc": layer.sc}
    arrays |= {"sw": layer.sw, "ss": layer.ss, "hout": h, "wout": weights, "iout": ids}
    emulate(gate_up_decode_kernel(s, gu), tmp_path, "gate_up")(n * gu.blocks, arrays, n)
    np.testing.assert_array_equal(ids, layer.ref_ids)
    np.testing.assert_allclose(weights, layer.ref_w, rtol=1e-5, atol=0)
    ref_h = layer.ref_h()
    assert rel_l2(h, ref_h) < TOL, f"h: rel L2 {rel_l2(h, ref_h):.2e}"

    out = np.full((n, s.hidden), np.nan, np.float16)
    arrays = {"h": h, "w": layer.dw, "sc": layer.ds, "sw": layer.sdw, "ss": layer.sds}
    arrays |= {"out": out, "wts": weights, "ids": ids}
    blocks = n * -(-s.hidden // dn.outputs_per_block)
    emulate(down_decode_kernel(s, dn), tmp_path, "down")(blocks, arrays, n)
    part = layer.ref_down(h)
    w = layer.ref_w[:, :, None]
    ref = (part[:, : s.top_k] * w).sum(1) + part[:, s.top_k]
    assert rel_l2(out, ref) < TOL, f"out: rel L2 {rel_l2(out, ref):.2e}"


def test_expert_major_kernels_at_v2_widths(tmp_path: Path) -> None:
    """The expert-major pair with the shipped tiles at V2's widths: rows of 5120 inputs staged
    in dynamic shared memory, runs of 256 with no tail of 128."""
    s, n = V2_WIDTHS, 1
    assert expert_mma_unsupported(s) is None
    layer = _Layer(s, n, seed=12)
    ids = layer.ref_ids.astype(np.int32)
    gu, dn = tuned("moe_expert_mma_gate_up"), tuned("moe_expert_mma_down")

    h = np.full((n, s.total), np.nan, np.float16)
    arrays = {"x": layer.x, "ids": ids, "w": layer.w, "s": layer.sc, "sw": layer.sw}
    arrays |= {"ss": layer.ss, "hout": h}
    emulate(gate_up_expert_mma_kernel(s, gu), tmp_path, "gate_up")(gu.blocks, arrays, n)
    ref_h = layer.ref_h()
    assert rel_l2(h, ref_h) < TOL, f"h: rel L2 {rel_l2(h, ref_h):.2e}"

    part = np.full((n, s.top_k + 1, s.hidden), np.nan, np.float32)
    arrays = {"h": h, "ids": ids, "w": layer.dw, "s": layer.ds, "sw": layer.sdw}
    arrays |= {"ss": layer.sds, "part": part}
    emulate(down_expert_mma_kernel(s, dn), tmp_path, "down")(dn.blocks, arrays, n)
    ref = layer.ref_down(h)
    assert rel_l2(part, ref) < TOL, f"part: rel L2 {rel_l2(part, ref):.2e}"
