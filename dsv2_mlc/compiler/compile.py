"""``dsv2-mlc compile``: HF checkpoint -> compiled library + converted weights + JSON config.

Everything is checked (config values, every checkpoint tensor's presence and shape) before any
output is produced; the output is built in a temporary folder beside OUT_DIR and moved into place
only when complete, so a failure leaves OUT_DIR exactly as it was.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..fsutil import staged_dir
from ..model.checkpoint import SafetensorsCheckpoint
from ..model.config import DeepseekV2Config
from ..model.weights import check_checkpoint, convert, weight_map
from ..quant import Quantization, get_quantization
from ..runtime.layout import (
    BUILD_CONFIG,
    FORMAT_VERSION,
    LIBRARY,
    PARAMS_DIR,
    TOKENIZER_FILES,
    BuildConfig,
)
from .cuda import DEFAULT_ARCH, check_fatbin, cuda_codegen, cuda_sources, make_cuda_target

DTYPES = ("float32", "float16")
DEVICES = ("cpu", "cuda")


class CompileError(UsageError):
    """A compile request that cannot be honoured (the message says why and what to do)."""


@dataclass(frozen=True)
class CompileResult:
    """Where the build went and what it cost."""

    out_dir: Path
    build: BuildConfig
    seconds: float


def make_target(device: str, arch: str = DEFAULT_ARCH):  # -> tvm.target.Target
    """The TVM target for ``device``; ``arch`` (e.g. ``"sm_90"``) applies to ``"cuda"`` only."""
    if device == "cuda":
        return make_cuda_target(arch)  # also readies TVM's CUDA codegen (see compiler/cuda.py)
    if device == "cpu":
        import tvm

        return tvm.target.Target({"kind": "llvm"})
    raise CompileError(f"unsupported --device {device!r}; supported: {', '.join(DEVICES)}")


@dataclass(frozen=True)
class BuildOptions:
    """Code-generation options recorded in the build (``BuildConfig``) for the runtime."""

    pdl: bool = False
    gemm: str = "tir"  # prefill / extend GEMMs: "tir" or "cublas" (passes/pipeline.py)


PDL_MIN_SM = 90  # griddepcontrol.* (PTX ISA 7.8) needs sm_90


def _build_options(
    device: str, arch: str, pdl: bool | None, gemm: str | None = None
) -> BuildOptions:
    """``pdl=None`` (the default): on for CUDA at sm_90 or newer, off otherwise; ``gemm=None``:
    ``"cublas"`` for CUDA, ``"tir"`` otherwise."""
    from ..passes.pipeline import GEMMS

    if gemm is None:
        gemm = "cublas" if device == "cuda" else "tir"
    if gemm not in GEMMS:
        raise CompileError(f"unsupported --gemm {gemm!r}; supported: {', '.join(GEMMS)}")
    if gemm == "cublas" and device != "cuda":
        raise CompileError(f"--gemm cublas is for --device cuda only, not {device!r}")
    sm = arch.removeprefix("sm_")
    pdl_arch = sm.isdigit() and int(sm) >= PDL_MIN_SM
    if pdl is None:
        pdl = device == "cuda" and pdl_arch
    if pdl and device != "cuda":
        raise CompileError(f"--pdl is for --device cuda only, not {device!r}")
    if pdl and not pdl_arch:
        raise CompileError(
            f"--pdl needs sm_{PDL_MIN_SM} or newer (griddepcontrol); --arch is {arch}"
        )
    return BuildOptions(pdl=pdl, gemm=gemm)


def _resolve_quantization(
    dtype: str | None,
    quantization: str | None,
    quantize_embedding: bool | None,
    quantize_lm_head: bool | None,
) -> Quantization:
    if dtype is not None and dtype not in DTYPES:
        raise CompileError(f"unsupported --dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    if quantization is None:
        quantization = "q0f16" if dtype == "float16" else "q0f32"
    quant = get_quantization(
        quantization, quantize_embedding=quantize_embedding, quantize_lm_head=quantize_lm_head
    )
    if dtype is not None and dtype != quant.dtype:
        raise CompileError(
            f"--dtype {dtype} contradicts --quantization {quant.name} (activations in "
            f"{quant.dtype}); drop --dtype"
        )
    return quant


def compile_model(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    quantization: str | None = None,
    quantize_embedding: bool | None = None,
    quantize_lm_head: bool | None = None,
    dump_ir: str | Path | None = None,
    progress: bool = True,
    arch: str = DEFAULT_ARCH,
    pdl: bool | None = None,
    gemm: str | None = None,
) -> CompileResult:
    """Compile the HF checkpoint in ``model_dir`` for ``device`` into ``out_dir``.

    ``quantization`` names a scheme of :mod:`dsv2_mlc.quant` (default: ``q0f32``, or
    ``q0f16`` with ``dtype="float16"``); ``dtype``, when also given, must agree with it.

    ``arch`` is the CUDA architecture for ``device="cuda"`` (kernels are precompiled for it with
    nvcc, also on a machine without a GPU; see :mod:`dsv2_mlc.compiler.cuda`).

    ``pdl`` (CUDA, sm_90 or newer; by default on there, ``False`` turns it off) builds for
    Programmatic Dependent Launch: every kernel waits with ``griddepcontrol.wait`` before it reads
    what earlier kernels wrote (first thing, or after its weight loads in the hand kernels), and
    the build says so (``BuildConfig.pdl``) so the runtime links the kernels of its decode graphs
    with programmatic edges (a decode step replays ~2.5 % faster on the H200,
    docs/benchmarks.md). The hand kernels release their successor's launch right after their
    wait (``griddepcontrol.launch_dependents``); TVM's kernels release it at their exit.

    ``gemm`` (default: ``"cublas"`` for CUDA, ``"tir"`` otherwise) picks who runs the prefill /
    extend GEMMs: cuBLAS (the library then needs libcublas at run time,
    :mod:`dsv2_mlc.runtime.cublas`) or the TIR kernels dlight schedules (no dependency).
    """
    start = time.perf_counter()
    quant = _resolve_quantization(dtype, quantization, quantize_embedding, quantize_lm_head)
    options = _build_options(device, arch, pdl, gemm)
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CompileError(f"{model_dir}: model folder not found")
    out_dir = Path(out_dir).resolve()
    _check_out_dir(out_dir)

    # 1. Everything that can be wrong with the input is found here, before any output exists.
    cfg = DeepseekV2Config.from_file(model_dir)
    ckpt = SafetensorsCheckpoint(model_dir)
    convs = weight_map(cfg)
    check_checkpoint(convs, ckpt)
    target = make_target(device, arch)

    try:
        with staged_dir(out_dir) as tmp:
            build = _build(cfg, ckpt, convs, target, device, quant, tmp, dump_ir, progress, options)
            for name in TOKENIZER_FILES:
                if (model_dir / name).is_file():
                    shutil.copy2(model_dir / name, tmp / name)
    finally:
        ckpt.close()
    return CompileResult(out_dir, build, time.perf_counter() - start)


def _build(
    cfg: DeepseekV2Config,
    ckpt: SafetensorsCheckpoint,
    convs: list,
    target,
    device: str,
    quant: Quantization,
    tmp: Path,
    dump_ir: str | Path | None,
    progress: bool,
    options: BuildOptions,
) -> BuildConfig:
    from tvm.contrib import tvmjs

    from ..quant import quantize_params

    mod, named_params, plan = _export(cfg, target, quant)
    param_dtypes = {name: str(p.dtype) for name, p in named_params}
    param_shapes = {name: tuple(int(s) for s in p.shape) for name, p in named_params}
    convert_dtypes = {**param_dtypes, **{name: "float32" for name in plan}}
    produced = []
    for name in (t for conv in convs for t in conv.targets):
        produced += [plan[name].q_weight, plan[name].q_scale] if name in plan else [name]
    if produced != [name for name, _ in named_params]:
        raise AssertionError("weight map and model parameters disagree (a bug in dsv2_mlc)")

    _compile_library(mod, target, device, tmp, dump_ir, options)

    def params() -> Iterator[tuple[str, np.ndarray]]:
        stream = quantize_params(convert(convs, ckpt, convert_dtypes), plan)
        if progress:
            from tqdm import tqdm

            stream = tqdm(stream, total=len(produced), desc="converting weights", unit="tensor")
        for name, arr in stream:
            if arr.shape != param_shapes[name]:
                raise AssertionError(
                    f"{name}: converted to {arr.shape}, model needs a different one"
                )
            yield name, arr

    with contextlib.redirect_stdout(io.StringIO()):  # it prints its own progress lines
        tvmjs.dump_tensor_cache(
            params(), str(tmp / PARAMS_DIR), encode_format="raw", show_progress=False
        )
    return _write_build_config(cfg, quant, device, target, produced, tmp, options)


def _export(cfg: DeepseekV2Config, target, quant: Quantization) -> tuple:
    """The traced (and for INT4, rewritten) model: (IRModule, named params, quantization plan)."""
    from ..model.deepseek_v2 import DeepseekV2ForCausalLM
    from ..quant.mutator import quantize_model

    model = DeepseekV2ForCausalLM(cfg, quant.dtype, target)
    plan = quantize_model(model, quant)
    with target:  # kernels chosen while tracing (the MoE router) follow Target.current()
        mod, named_params = model.export_tvm(spec=model.get_default_spec())
    return model.annotate_entries(mod), named_params, plan


def _compile_library(
    mod, target, device: str, tmp: Path, dump_ir: str | Path | None, options: BuildOptions
) -> None:
    """Run the pipeline, compile and export ``tmp/model.so`` (CUDA: with precompiled kernels)."""
    import tvm

    from ..passes.pipeline import PipelineOptions, build_pipeline, tir_pipeline
    from .extern_gemm import LINK_OPTIONS, build_cublas_shim

    with tempfile.TemporaryDirectory() as work:
        # the shim first: a missing C++ compiler fails before minutes of codegen
        addons = [str(build_cublas_shim(work))] if options.gemm == "cublas" else []
        codegen = cuda_codegen() if device == "cuda" else contextlib.nullcontext()
        with target, codegen:  # the nvcc callback reads its -arch from Target.current()
            executable = tvm.compile(
                mod,
                target=target,
                relax_pipeline=build_pipeline(target, dump_ir, PipelineOptions(options.gemm)),
                tir_pipeline=tir_pipeline(options.pdl),
            )
        if options.pdl:
            check_pdl_kernels(executable.mod)
        link = {"addons": addons, "options": LINK_OPTIONS} if addons else {}
        executable.export_library(str(tmp / LIBRARY), **link)
    if device == "cuda":
        check_fatbin(tmp / LIBRARY, str(target.arch))


def check_pdl_kernels(module) -> int:  # (tvm.runtime.Module) -> int
    """Raise ``AssertionError`` unless every CUDA kernel of ``module`` starts with
    ``griddepcontrol.wait``; the number of kernels."""
    from ..passes.grid_dependency_control import kernels_without_wait

    total = 0
    for source in cuda_sources(module):
        kernels, missing = kernels_without_wait(source)
        if missing:
            raise AssertionError(f"kernels without griddepcontrol.wait: {', '.join(missing)}")
        total += len(kernels)
    if total == 0:
        raise AssertionError("a PDL build with no CUDA kernel")
    return total


def _write_build_config(
    cfg: DeepseekV2Config,
    quant: Quantization,
    device: str,
    target,
    param_names: list[str],
    tmp: Path,
    options: BuildOptions,
) -> BuildConfig:
    import tvm
    import tvm_ffi

    build = BuildConfig(
        format_version=FORMAT_VERSION,
        model=cfg.to_dict(),
        dtype=quant.dtype,
        quantization=quant.name,
        device=device,
        target=str(target.export()),
        param_names=param_names,
        tvm_version=tvm.__version__,
        tvm_ffi_version=tvm_ffi.__version__,
        pdl=options.pdl,
        gemm=options.gemm,
    )
    (tmp / BUILD_CONFIG).write_text(json.dumps(build.to_dict(), indent=1))
    return build


def compile_random_model(
    config: str | Path,
    out_dir: str | Path,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    quantization: str | None = None,
    quantize_embedding: bool | None = None,
    quantize_lm_head: bool | None = None,
    dump_ir: str | Path | None = None,
    arch: str = DEFAULT_ARCH,
    pdl: bool | None = None,
    gemm: str | None = None,
) -> CompileResult:
    """Compile from a ``config.json`` alone (a file or the folder holding it), for benchmarks.

    The build has no converted weights: its library carries fill kernels and ``OUT/random-params
    .json`` says how to fill every parameter, so the runtime creates deterministic random weights
    on the device at load time (``Engine(OUT, random_weights=SEED)``; see
    :mod:`dsv2_mlc.runtime.random_params`). Options as :func:`compile_model`.
    """
    from ..runtime.random_params import init_spec, write_spec
    from .random_fill import add_fill_kernels

    start = time.perf_counter()
    quant = _resolve_quantization(dtype, quantization, quantize_embedding, quantize_lm_head)
    options = _build_options(device, arch, pdl, gemm)
    out_dir = Path(out_dir).resolve()
    _check_out_dir(out_dir)
    cfg = DeepseekV2Config.from_file(config)
    target = make_target(device, arch)

    with staged_dir(out_dir) as tmp:
        mod, named_params, _ = _export(cfg, target, quant)
        mod = add_fill_kernels(mod, (quant.dtype, "float32"))
        _compile_library(mod, target, device, tmp, dump_ir, options)
        spec = init_spec((name, p.shape, p.dtype) for name, p in named_params)
        write_spec(tmp, spec)
        names = [p.name for p in spec]
        build = _write_build_config(cfg, quant, device, target, names, tmp, options)
    return CompileResult(out_dir, build, time.perf_counter() - start)


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise CompileError(f"{out_dir}: exists and is not a folder; choose another output path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / BUILD_CONFIG).is_file():
        raise CompileError(
            f"{out_dir}: folder is not empty and is not a dsv2-mlc build; "
            "choose a new or empty output folder"
        )
