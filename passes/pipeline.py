"""The phased Relax pipeline of dsv2-mlc, with an optional IR dump after each phase.

Phases, in order (weight quantization, ``QuantizeInt4``, rewrites the nn model before export):

1. ``rewrite``: the project's own fusions at the Relax level: ``FuseDequantizeMatmul`` (INT4
   dequantisation inside the matmul), ``FuseAddRMSNorm`` (residual add + RMSNorm) and
   ``FuseGateUpSiluMul`` (SwiGLU over the fused gate/up projection); with ``gemm="cublas"``
   (:class:`PipelineOptions`) also ``DispatchCublasGemm`` (prefill / extend GEMMs to cuBLAS).
2. ``cleanup``: fold the remaining weight transposes into their matmuls (``FuseTransposeMatmul``)
   so no transposed weight is materialised per call, then drop dead code.
3. ``fuse``: legalize Relax ops to TIR, annotate op patterns, and fuse producer/consumer chains
   into single kernels (``FuseOps`` + ``FuseTIR``).
4. ``schedule``: per-target kernel schedules (GPU targets: hand schedules for the tagged decode
   kernels, ``ScheduleDecodeKernels``, then dlight rules for the rest; LLVM: none yet).
5. ``lower``: TVM's VM lowering (memory planning, builtins, shape lowering).

The TIR pipeline that lowers the kernels afterwards is TVM's default; :func:`tir_pipeline` names
a variant for Programmatic Dependent Launch that also prepends ``griddepcontrol.wait`` to every
CUDA kernel (``InsertGridDependencyControl``), ours and the ones TVM adds (the KV cache's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tvm
from tvm import relax
from tvm.ir import IRModule
from tvm.target import Target

GEMMS = ("tir", "cublas")


@dataclass(frozen=True)
class PipelineOptions:
    """Build choices that change the Relax pipeline.

    ``gemm``: who runs the prefill / extend GEMMs, ``"tir"`` (dlight's schedules, any target) or
    ``"cublas"`` (CUDA: ``DispatchCublasGemm``; the library then carries
    ``runtime/cublas_gemm.cc`` and needs libcublas at run time)."""

    gemm: str = "tir"

    def __post_init__(self) -> None:
        if self.gemm not in GEMMS:
            raise ValueError(f"gemm {self.gemm!r} not in {GEMMS}")


Phase = tuple[str, Callable[[Target, PipelineOptions], list[tvm.transform.Pass]]]


def _rewrite(target: Target, options: PipelineOptions) -> list[tvm.transform.Pass]:
    from .dispatch_cublas_gemm import DispatchCublasGemm
    from .fuse_add_rms_norm import FuseAddRMSNorm
    from .fuse_dequantize_matmul import FuseDequantizeMatmul
    from .fuse_gate_up_silu_mul import FuseGateUpSiluMul

    passes = [FuseDequantizeMatmul, FuseAddRMSNorm, FuseGateUpSiluMul]
    if options.gemm == "cublas":
        if target.kind.name != "cuda":
            raise ValueError(f"gemm='cublas' needs a CUDA target, not {target.kind.name}")
        passes.append(DispatchCublasGemm)
    return passes


def _cleanup(_target: Target, _options: PipelineOptions) -> list[tvm.transform.Pass]:
    return [relax.transform.FuseTransposeMatmul(), relax.transform.DeadCodeElimination()]


def _fuse(_target: Target, _options: PipelineOptions) -> list[tvm.transform.Pass]:
    return [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]


def _guarded(rule):  # (dl.ScheduleRule) -> dl.ScheduleRule
    """``rule``, with an exception in its analysis counted as "does not apply".

    dlight's GEMV and Reduction analyses assert on reductions whose input is read at two offsets
    (a SwiGLU prologue left to dlight when our decode schedule declines it); the next rule (at
    worst Fallback) must get the kernel then instead of the build failing."""
    from tvm.s_tir import dlight as dl

    class Guarded(dl.ScheduleRule):
        def apply(self, func, target, tunable):  # noqa: ANN001, ANN201
            try:
                return rule.apply(func, target, tunable)
            except Exception:  # noqa: BLE001
                return None

    return Guarded()


def _schedule(target: Target, _options: PipelineOptions) -> list[tvm.transform.Pass]:
    if "gpu" not in target.keys:
        return []
    from tvm.s_tir import dlight as dl

    from .schedule_decode_kernels import ScheduleDecodeKernels

    return [
        ScheduleDecodeKernels,
        dl.ApplyDefaultSchedule(
            _guarded(dl.gpu.Matmul()),
            _guarded(dl.gpu.GEMV()),
            _guarded(dl.gpu.Reduction()),
            _guarded(dl.gpu.GeneralReduction()),
            dl.gpu.Fallback(),
        ),
    ]


def _lower(_target: Target, _options: PipelineOptions) -> list[tvm.transform.Pass]:
    return [relax.pipeline.default_build_pipeline()]


PHASES: list[Phase] = [
    ("rewrite", _rewrite),
    ("cleanup", _cleanup),
    ("fuse", _fuse),
    ("schedule", _schedule),
    ("lower", _lower),
]


def _dump_pass(path: Path) -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name=f"Dump[{path.name}]")
    def dump(mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(mod.script(show_meta=False))
        return mod

    return dump


def tir_pipeline(pdl: bool = False) -> str:
    """The name of the TIR pipeline to pass to ``tvm.compile(..., tir_pipeline=...)``.

    ``"default"`` unless ``pdl``; with ``pdl``, TVM's default pipeline with
    ``InsertGridDependencyControl`` after its device finalisation passes
    (registered with TVM under a dsv2-mlc name on first use: ``tvm.compile`` takes TIR
    pipelines by name only)."""
    if not pdl:
        return "default"
    from tvm.tirx import compilation_pipeline

    from .grid_dependency_control import InsertGridDependencyControl

    name = "dsv2_mlc_pdl"

    def make() -> tuple:
        lower, finalize_host, finalize_device = compilation_pipeline.get_tir_pipeline("default")

        def finalize_device_pdl() -> tvm.transform.Pass:
            return tvm.transform.Sequential([finalize_device(), InsertGridDependencyControl()])

        return lower, finalize_host, finalize_device_pdl

    compilation_pipeline.register_tir_pipeline(name, make)
    return name


def build_pipeline(
    target: Target,
    dump_dir: str | Path | None = None,
    options: PipelineOptions = PipelineOptions(),  # noqa: B008 (frozen)
) -> tvm.transform.Pass:
    """The whole pipeline for ``target``; with ``dump_dir``, IR is written after every phase."""
    passes: list[tvm.transform.Pass] = []
    if dump_dir is not None:
        passes.append(_dump_pass(Path(dump_dir) / "00-input.py"))
    for i, (name, make) in enumerate(PHASES, start=1):
        passes += make(target, options)
        if dump_dir is not None:
            passes.append(_dump_pass(Path(dump_dir) / f"{i:02d}-{name}.py"))
    return tvm.transform.Sequential(passes, name="dsv2_mlc_pipeline")
