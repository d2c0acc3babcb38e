"""The latent cache's CUDA append (``schedules/mla_append_cuda.py``) on the CPU against NumPy
(``tests/cuda_emulation.py``): every row lands in its page slot, rows mapped to -1 and every other
slot stay as they were, element offsets of the pages and the position map are honoured."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.mla_append_cuda import mla_append_cuda, mla_append_cuda_supports

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain  # noqa: E402

PAGE = 16


@needs_toolchain
@pytest.mark.parametrize(
    ("d_qk", "dtype", "pages", "ntoken", "offsets"),
    [
        (576, "float16", 5, 9, (0, 0)),  # V2 / V2-Lite latent rows, 72 threads a token
        (64, "float32", 3, 4, (PAGE * 64, 3)),  # offset pages (one page) and position map
        (40, "float16", 2, 1, (0, 1)),  # one decode token, 5 threads
    ],
    ids=["v2-latent", "offsets", "decode"],
)
def test_append_matches_numpy(
    tmp_path: Path, d_qk: int, dtype: str, pages: int, ntoken: int, offsets: tuple[int, int]
) -> None:
    rng = np.random.default_rng(d_qk + ntoken)
    page_off, map_off = offsets
    pool = rng.standard_normal(page_off + pages * PAGE * d_qk).astype(dtype)
    kv = rng.standard_normal((ntoken, d_qk)).astype(dtype)
    slots = rng.permutation(pages * PAGE)[:ntoken].astype(np.int32)
    if ntoken > 2:
        slots[1] = -1  # a row the cache does not store (TVM's convention)
    pos = np.concatenate([np.full(map_off, 12345, np.int32), slots])  # junk before the offset
    want = pool.copy()
    view = want[page_off:].reshape(pages, PAGE, d_qk)
    for t, p in enumerate(slots):
        if p != -1:
            view[p // PAGE, p % PAGE] = kv[t]

    kernel = emulate(mla_append_cuda(d_qk, dtype, PAGE), tmp_path)
    assert set(kernel.buffers) == {"pages", "kv_data", "position_map"}, kernel.buffers
    scalars = {"ntoken": ntoken, "pages_elem_offset": page_off, "position_map_elem_offset": map_off}
    kernel(ntoken, {"pages": pool, "kv_data": kv, "position_map": pos},
           *[scalars[s] for s in kernel.scalars])  # fmt: skip
    np.testing.assert_array_equal(pool, want)


def test_append_supports_whole_vectors_only() -> None:
    assert mla_append_cuda_supports(576, "float16")
    assert not mla_append_cuda_supports(36, "float16")  # 72 bytes: not whole 16-byte pieces
    assert not mla_append_cuda_supports(576, "bfloat16")
    assert not mla_append_cuda_supports(16 * 1025, "float16")  # > 1024 threads a token
    with pytest.raises(ValueError, match="16-byte"):
        mla_append_cuda(36, "float16")
