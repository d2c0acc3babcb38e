"""The decode entry point for batches, ``batch_decode_expert_major`` (CUDA builds). Where a MoE
layer's shape fits the tensor-core expert-major kernels (``schedules/moe_expert_mma_cuda.py``) its
MoE layers call them (then the float32 weighted sum) and ``batch_decode`` keeps the fused
per-token kernels; where it does not (the tiny test configs' 64-wide hidden) both call the fused
kernels; LLVM builds have no such entry. ``batch_decode_gemm`` runs the grouped GEMMs, or the
expert-major kernels where the tile table's ``decode_gemm`` entry says so. Traced to the fuse
phase (no CUDA compile)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tvm

from dsv2_mlc.layout import LIBRARY
from dsv2_mlc.model.config import DeepseekV2Config
from dsv2_mlc.quant import get_quantization

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import model_build, needs_nvcc  # noqa: E402
from hf_reference import CONFIG_A  # noqa: E402
from scripts_module import load_script  # noqa: E402
from test_moe_grouped import _called  # noqa: E402

EXPERT_MAJOR = {"moe_expert_major_gate_up", "moe_expert_major_down"}
FUSED = {"moe_decode_gate_up"}
GROUPED = "moe_grouped"  # the grouped GEMMs' kernels: moe_grouped_q4_gate_up, ...
# CONFIG_A with MoE widths the MMA kernels tile (multiples of 128)
CONFIG_MMA = {**CONFIG_A, "hidden_size": 256, "moe_intermediate_size": 128}
V2_SHAPED = load_script("gpu_v2_numerics").V2_SHAPED


def _entries(
    cfg: dict,
    target: tvm.target.Target,
    entries: tuple[str, ...] = ("batch_decode", "batch_decode_expert_major"),
) -> dict[str, set]:
    from dsv2_mlc.compiler.compile import _export
    from dsv2_mlc.passes.pipeline import PHASES, PipelineOptions

    mod, _, _ = _export(DeepseekV2Config.from_hf(cfg), target, get_quantization("q4f16_g32"))
    with target:
        passes = [p for name, make in PHASES[:3] for p in make(target, PipelineOptions())]
        mod = tvm.transform.Sequential(passes)(mod)
    names = {gv.name_hint for gv, _ in mod.functions_items()}
    return {e: {gv.name_hint for gv in _called(mod[e])} for e in entries if e in names}


@pytest.mark.parametrize(
    ("cfg", "mma"), [(CONFIG_MMA, True), (CONFIG_A, False)], ids=["mma", "tiny"]
)
def test_expert_major_entry_calls_the_mma_kernels_where_they_fit(cfg: dict, mma: bool) -> None:
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    called = _entries(cfg, cuda)
    assert FUSED <= called["batch_decode"] and not called["batch_decode"] & EXPERT_MAJOR
    major = called["batch_decode_expert_major"]
    if mma:
        assert EXPERT_MAJOR <= major and not major & FUSED, sorted(major)
    else:
        assert FUSED <= major and not major & EXPERT_MAJOR, sorted(major)


def _major(called: set) -> set:
    """The expert-major kernels among ``called`` (a second entry's copies get a suffix)."""
    return {k for k in EXPERT_MAJOR if any(c == k or c.startswith(k + "_") for c in called)}


@pytest.mark.parametrize("moe", ["grouped", "expert_major"])
def test_decode_gemm_entry_takes_its_moe_kernels_from_the_tile_table(
    moe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsv2_mlc.schedules import tiles

    key = tiles.TileKey()
    monkeypatch.setitem(tiles.TABLE, "decode_gemm", {key: tiles.DecodeGemmTiles(moe=moe)})
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    gemm = _entries(CONFIG_MMA, cuda, ("batch_decode_gemm",))["batch_decode_gemm"]
    grouped = {c for c in gemm if c.startswith(GROUPED)}
    if moe == "expert_major":
        assert _major(gemm) == EXPERT_MAJOR and not grouped, sorted(gemm)
    else:
        assert grouped and not _major(gemm), sorted(gemm)
    assert not gemm & FUSED


def test_decode_gemm_moe_must_be_known(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv2_mlc.errors import UsageError
    from dsv2_mlc.schedules import tiles

    bad = {tiles.TileKey(): tiles.DecodeGemmTiles(moe="expert-major")}
    monkeypatch.setitem(tiles.TABLE, "decode_gemm", bad)
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    with pytest.raises(UsageError, match="moe='expert-major' is not one of"):
        _entries(CONFIG_MMA, cuda, ("batch_decode_gemm",))


@needs_nvcc
def test_cuda_build_with_the_mma_kernels_compiles() -> None:
    """The whole module compiles for sm_90 with the MMA kernels beside the attention and grouped
    GEMM kernels (one ``extern __shared__`` array for all of them: the same element type) and
    exports the entry point. The build: the session's of the DeepSeek-V2-shaped config
    (``tests/test_v2_cuda_build.py``), whose MoE widths the MMA kernels tile."""
    build = model_build(V2_SHAPED, "q4f16_g128", "cuda")
    (major,) = build.entries(("batch_decode_expert_major",), "03-fuse.py")
    called = set(re.findall(r"cls\.(\w+),", major))
    assert EXPERT_MAJOR <= called and not called & FUSED, sorted(called)
    lib = (build.out_dir / LIBRARY).read_bytes()
    assert b"batch_decode_expert_major" in lib and b"batch_decode_gemm" in lib


def test_llvm_builds_have_no_expert_major_entry() -> None:
    assert set(_entries(CONFIG_MMA, tvm.target.Target({"kind": "llvm"}))) == {"batch_decode"}


def test_expert_major_threshold_must_be_a_sequence_count(compiled) -> None:
    from dsv2_mlc.bench import BenchError, BenchOptions
    from dsv2_mlc.runtime.engine import Engine

    with pytest.raises(ValueError, match="expert_major_from must be at least 1"):
        Engine(compiled["A"], context_window=64, max_batch_size=1, expert_major_from=0)
    with pytest.raises(BenchError, match="--expert-major-from"):
        BenchOptions(model="x", expert_major_from=0).check()
    cpu = Engine(compiled["A"], context_window=64, max_batch_size=1)
    assert cpu.expert_major_from is None  # a CPU build has no such entry
