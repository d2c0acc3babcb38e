"""The decode GEMV schedule (``schedules/decode_gemv_cuda.py``) run on the CPU, no GPU.

The model's decode entry point gives two INT4 kernels this schedule
(``passes/schedule_decode_kernels.py``; the other GEMVs of decode are hand kernels): the dense
MLP's gate/up projection (a float32 dot product cast to float16) and the lm_head (cast to float16,
then to float32); with q-LoRA also ``q_b_proj`` (cast to float16). Each is built here as the model
fuses it, at V2-Lite's widths (INT4 group 128: 21,888 x 2,048 and 102,400 x 2,048,
:func:`~decode_gemv_cuda.config_for` picks the hfma2 configurations ``WIDE`` and ``VOCAB``), at
DeepSeek-V2's (236B: hidden 5120, the dense gate/up in the ``LONG_K`` class; ``q_b_proj``, 24,576
x 1,536, ``WIDE``) and at the tiny test models' (group 32, K = 64: the legacy split rule),
scheduled with the shipped choice (``config=None``), and TVM's CUDA runs under
``tests/cuda_emulation.py`` against a float64 NumPy reference (INT4 groups dequantized, matmul).

The V2-Lite and V2 grids are run in part: the first blocks of the output axis (every block runs
the same code on its own rows), for two batch rows (``blockIdx.y``); the weights passed hold only
those blocks' rows (a read past them fails under AddressSanitizer) and the outputs past them must
stay untouched. The tolerance follows the arithmetic: the hfma2 dot product accumulates 16
products per half lane in fp16, so a relative L2 error of a few fp16 unit roundoffs; float32
accumulation leaves the final fp16 rounding alone. Controls: the lanes' shuffle reduction with
one step dropped, and the scales read one group off, must fail.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tvm import te, tirx

from dsv2_mlc.passes.fuse_dequantize_matmul import dequantize_matmul_te
from dsv2_mlc.schedules.decode_gemv_cuda import schedule_decode_gemv
from dsv2_mlc.schedules.tiles import tuned

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain, random_int4, rel_l2  # noqa: E402

pytestmark = needs_toolchain
U16 = 2.0**-11  # fp16 unit roundoff
BATCH = 2  # decode rows (blockIdx.y)


def _gemv(n_out: int, k: int, group: int, lm_head: bool) -> tirx.PrimFunc:
    """The fused decode kernel: ``dequantize_matmul`` (float32) cast to float16 (gate/up), or
    to float16 and back to float32 (the lm_head's logits), over ``batch_size`` rows."""
    n = tirx.Var("batch_size", "int64")
    i64 = lambda *d: tuple(tirx.IntImm("int64", v) for v in d)  # noqa: E731
    x = te.placeholder((n, *i64(k)), "float16", name="x")
    qw = te.placeholder(i64(n_out, k // 8), "uint32", name="qw")
    qs = te.placeholder(i64(n_out, -(-k // group)), "float16", name="qs")
    acc = dequantize_matmul_te(x, qw, qs, k, group, out_dtype="float32")
    name = "cast" if lm_head else "out"
    y = te.compute(acc.shape, lambda *i: acc(*i).astype("float16"), name=name)
    if lm_head:
        y = te.compute(y.shape, lambda *i: y(*i).astype("float32"), name="out")
    return te.create_prim_func([x, qw, qs, y])


def _blocks_x(func: tirx.PrimFunc) -> tuple[int, bool]:
    """The ``blockIdx.x`` extent per batch row, and whether the batch is fused into it (the
    legacy schedule) rather than ``blockIdx.y``."""
    (ext,) = set(re.findall(r'T\.thread_binding\(([^,]+), thread="blockIdx\.x"\)', func.script()))
    const = re.fullmatch(r"(batch_size \* )?T\.int64\((\d+)\)", ext)
    assert const, ext
    return int(const.group(2)), const.group(1) is not None


def _run(
    tmp_path: Path,
    n_out: int,
    k: int,
    group: int,
    lm_head: bool,
    blocks: int | None,
    patch: Callable[[str], str] | None = None,
) -> float:
    """Emulate the scheduled kernel on the first ``blocks`` blocks of the output axis (None: all)
    and return the relative L2 error of the outputs they own; checks the rest is untouched."""
    func = schedule_decode_gemv(_gemv(n_out, k, group, lm_head))
    assert func is not None
    grid_x, fused = _blocks_x(func)
    per_block = n_out // grid_x
    blocks = grid_x if blocks is None else blocks
    rows = blocks * per_block
    assert not fused or blocks == grid_x
    rng = np.random.default_rng(n_out + k)
    qw, qs, w = random_int4(rng, (rows,), k, group)
    x = rng.standard_normal((BATCH, k)).astype(np.float16)
    out_dtype = np.float32 if lm_head else np.float16
    y = np.full((BATCH, n_out), np.nan, out_dtype)
    run = emulate(func, tmp_path, patch=patch)
    run(
        (BATCH * blocks, 1) if fused else (blocks, BATCH),
        {"x": x, "qw": qw, "qs": qs, "out": y},
        BATCH,
    )
    assert np.isnan(y[:, rows:]).all(), "an output past the blocks run was written"
    ref = x.astype(np.float64) @ w.T
    return rel_l2(y[:, :rows], ref)


WIDE, VOCAB = tuned("decode_gemv", shape="wide"), tuned("decode_gemv", shape="vocab")
V2_LITE = [  # (n_out, K, group, lm_head, the config the shipped choice takes, blocks run)
    pytest.param(21888, 2048, 128, False, WIDE, 16, id="v2lite_dense_gate_up"),
    pytest.param(102400, 2048, 128, True, VOCAB, 8, id="v2lite_lm_head"),
]
LONG_K = tuned("decode_gemv", shape="long_k")
V2 = [  # DeepSeek-V2 (236B), hidden 5120: 160 groups a row; q-LoRA's q_b_proj (K = 1536)
    pytest.param(24576, 5120, 128, False, LONG_K, 16, id="v2_dense_gate_up"),
    pytest.param(102400, 5120, 128, True, VOCAB, 8, id="v2_lm_head"),
    pytest.param(24576, 1536, 128, False, WIDE, 16, id="v2_q_b_proj"),
]
TINY = [
    pytest.param(320, 64, 32, False, None, None, id="tiny_dense_gate_up"),
    pytest.param(512, 64, 32, True, None, None, id="tiny_lm_head"),
]


@pytest.mark.parametrize(
    ("n_out", "k", "group", "lm_head", "config", "blocks"), V2_LITE + V2 + TINY
)
def test_decode_gemv_matches_numpy(tmp_path, n_out, k, group, lm_head, config, blocks):
    if config is not None:  # the shipped choice at the model's shape: the table's for its class
        func = _gemv(n_out, k, group, lm_head)
        assert schedule_decode_gemv(func).script() == schedule_decode_gemv(func, config).script()
    # fp16 partial sums (hfma2) or float32 ones; then the fp16 rounding of the output
    tol = 4 * U16 if config is not None and config.hfma2 else U16
    err = _run(tmp_path, n_out, k, group, lm_head, blocks)
    assert err < tol, f"rel L2 {err:.2e} (tolerance {tol:.1e})"


def _drop_last_shuffle(src: str) -> str:
    """The lanes' reduction without its last step (lane 0 misses every odd lane's sum)."""
    step = r"t0_ptr\[0\] = __shfl_down_sync\([^;]*, 1, 32\);\s*red_buf0_ptr\[0\] = [^;]*;"
    out, n = re.subn(step, "", src)
    assert n, "no shuffle step to drop"
    return out


def _swap_scale_groups(src: str) -> str:
    """Every scale read from the neighbouring group (index ^ 1: stays in bounds)."""
    out, n = re.subn(r"qs_ptr\[", "qs_ptr[1 ^ ", src)
    assert n, "no scale read"
    return out


@pytest.mark.parametrize(
    ("case", "patch"),
    [
        (V2_LITE[1], _drop_last_shuffle),
        (V2_LITE[0], _swap_scale_groups),
        (TINY[0], _drop_last_shuffle),
        (TINY[1], _swap_scale_groups),
    ],
    ids=["v2lite_lm_head_reduction", "v2lite_gate_up_scales", "tiny_reduction", "tiny_scales"],
)
def test_decode_gemv_broken_variants_fail(tmp_path, case, patch):
    """The controls: the same kernels with a step of the cross-lane reduction dropped, or the
    scales one group off, miss the tolerance by far."""
    n_out, k, group, lm_head, _, blocks = case.values
    err = _run(tmp_path, n_out, k, group, lm_head, blocks, patch=patch)
    assert err > 50 * U16, f"rel L2 {err:.2e}: the broken kernel passes"
