"""``dsv2-mlc compile``: HF checkpoint -> compiled library + converted weights + JSON config.

Everything is checked (config values, every checkpoint tensor's presence and shape) before any
output is produced; the output is built in a temporary folder beside OUT_DIR and moved into place
only when complete, so a failure leaves OUT_DIR exactly as it was. OUT_DIR is replaced only when
it is empty or holds exactly an earlier build (:func:`foreign_entries` lists anything else), and
never when an input or the IR dump lies inside it: such a request is refused before any work.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..fsutil import staged_dir
from ..layout import (
    BUILD_CONFIG,
    FORMAT_VERSION,
    LIBRARY,
    PARAMS_DIR,
    SPEC_FILE,
    TOKENIZER_FILES,
    BuildConfig,
    file_records,
)
from ..model.checkpoint import SafetensorsCheckpoint
from ..model.config import DeepseekV2Config
from ..model.weights import check_checkpoint, convert, weight_map
from ..quant import Quantization, get_quantization
from .cuda import DEFAULT_ARCH, check_fatbin, cuda_codegen, cuda_sources, make_cuda_target

DTYPES = ("float32", "float16")
DEVICES = ("cpu", "cuda")
# --kv-dtype: the latent KV cache's element type (BuildConfig.kv_dtype; "" = the build's dtype)
KV_DTYPES = {"float16": "", "float32": "", "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}


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
    kv_dtype: str = ""  # the latent cache's element type (BuildConfig.kv_dtype)
    kv_scale: float = 1.0  # its static scale (FP8: stored = x / kv_scale)


PDL_MIN_SM = 90  # griddepcontrol.* (PTX ISA 7.8) needs sm_90


def _kv_format(kv_dtype: str | None, kv_scale: float | None, dtype: str) -> tuple[str, float]:
    """(BuildConfig.kv_dtype, kv_scale) of ``--kv-dtype`` / ``--kv-scale`` for activations in
    ``dtype``: ``None`` or the activation dtype -> ``""``; ``fp8`` -> ``float8_e4m3fn``."""
    if kv_dtype is None:
        kv_dtype = dtype
    if kv_dtype not in KV_DTYPES or (KV_DTYPES[kv_dtype] == "" and kv_dtype != dtype):
        raise CompileError(
            f"unsupported --kv-dtype {kv_dtype!r} for activations in {dtype}; supported: "
            f"{dtype} (the default) or fp8 (float8_e4m3fn latent values)"
        )
    stored = KV_DTYPES[kv_dtype]
    if kv_scale is None:
        kv_scale = 1.0
    if not (isinstance(kv_scale, (int, float)) and math.isfinite(kv_scale) and kv_scale > 0):
        raise CompileError(f"--kv-scale must be a finite number > 0, got {kv_scale!r}")
    if kv_scale != 1.0 and not stored:
        raise CompileError("--kv-scale applies to --kv-dtype fp8 only")
    return stored, float(kv_scale)


def _build_options(
    device: str,
    arch: str,
    pdl: bool | None,
    gemm: str | None = None,
    kv: tuple[str, float] = ("", 1.0),
) -> BuildOptions:
    """``pdl=None`` (the default): on for CUDA at sm_90 or newer, off otherwise; ``gemm=None``:
    ``"cublas"`` for CUDA, ``"tir"`` otherwise; ``kv``: :func:`_kv_format`'s pair."""
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
    return BuildOptions(pdl=pdl, gemm=gemm, kv_dtype=kv[0], kv_scale=kv[1])


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
    kv_dtype: str | None = None,
    kv_scale: float | None = None,
) -> CompileResult:
    """Compile the HF checkpoint in ``model_dir`` for ``device`` into ``out_dir``.

    ``quantization`` names a scheme of :mod:`dsv2_mlc.quant` (default: ``q0f32``, or
    ``q0f16`` with ``dtype="float16"``); ``dtype``, when also given, must agree with it.

    ``arch`` is the CUDA architecture for ``device="cuda"`` (kernels are precompiled for it with
    nvcc, also on a machine without a GPU; see :mod:`dsv2_mlc.compiler.cuda`).

    ``pdl`` (CUDA, sm_90 or newer; by default on there, ``False`` turns it off) builds for
    Programmatic Dependent Launch: every kernel waits with ``griddepcontrol.wait`` before it reads
    what earlier kernels wrote (first thing, or after its weight loads in the hand kernels), and the
    build says so (``BuildConfig.pdl``) so the runtime links the kernels of its decode graphs with
    programmatic edges: each kernel is launched while its predecessor drains
    (schedules/results/decode_kernels.md). The hand kernels release their successor's launch right
    after their wait (``griddepcontrol.launch_dependents``); TVM's kernels release it at their exit.

    ``gemm`` (default: ``"cublas"`` for CUDA, ``"tir"`` otherwise) picks who runs the prefill /
    extend GEMMs: cuBLAS (the library then needs libcublas at run time,
    :mod:`dsv2_mlc.runtime.cublas`) or the TIR kernels dlight schedules (no dependency).

    ``kv_dtype`` is the latent KV cache's element type: the activation dtype (default) or
    ``"fp8"`` (the latent values e4m3, one byte each, the rope part in ``dtype``: 56 % of a
    float16 cache; ``kv_scale``, default 1.0, is its static scale, latent values stored as ``x /
    kv_scale``; :mod:`dsv2_mlc.schedules.kv_fp8`).
    """
    start = time.perf_counter()
    quant = _resolve_quantization(dtype, quantization, quantize_embedding, quantize_lm_head)
    kv = _kv_format(kv_dtype, kv_scale, quant.dtype)
    options = _build_options(device, arch, pdl, gemm, kv)
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CompileError(f"{model_dir}: model folder not found")
    out_dir = Path(out_dir).resolve()
    _check_out_dir(out_dir, (model_dir,), dump_ir)

    # 1. Everything that can be wrong with the input is found here, before any output exists.
    cfg = DeepseekV2Config.from_file(model_dir)
    ckpt = SafetensorsCheckpoint(model_dir)
    convs = weight_map(cfg)
    check_checkpoint(convs, ckpt)
    target = make_target(device, arch)

    try:
        with staged_dir(out_dir, _check_out_dir) as tmp:
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

    mod, named_params, plan = _export(cfg, target, quant, options)
    param_dtypes = {name: str(p.dtype) for name, p in named_params}
    param_shapes = {name: tuple(int(s) for s in p.shape) for name, p in named_params}
    produced = []
    for name in (t for conv in convs for t in conv.targets):
        produced += [plan[name].q_weight, plan[name].q_scale] if name in plan else [name]
    if produced != [name for name, _ in named_params]:
        raise AssertionError("weight map and model parameters disagree (a bug in dsv2_mlc)")

    _compile_library(mod, target, device, tmp, dump_ir, options)

    def params() -> Iterator[tuple[str, np.ndarray]]:
        stream = converted_params(convs, ckpt, param_dtypes, plan)
        if progress:
            from tqdm import tqdm

            stream = tqdm(stream, total=len(produced), desc="converting weights", unit="tensor")
        for name, arr in stream:
            if arr.shape != param_shapes[name]:
                raise AssertionError(
                    f"{name}: converted to {arr.shape}, model needs a different one"
                )
            yield name, arr
            del arr  # not held while the next parameter is converted

    with contextlib.redirect_stdout(io.StringIO()):  # it prints its own progress lines
        tvmjs.dump_tensor_cache(
            params(), str(tmp / PARAMS_DIR), encode_format="raw", show_progress=False
        )
    return _write_build_config(cfg, quant, device, target, produced, tmp, options)


def converted_params(
    convs: list, ckpt: SafetensorsCheckpoint, param_dtypes: dict[str, str], plan: dict
) -> Iterator[tuple[str, np.ndarray]]:
    """The model's parameters from the checkpoint, in order and one at a time: converted
    (:func:`~dsv2_mlc.model.weights.convert`) into ``param_dtypes``, or for the names in
    ``plan`` INT4-quantized from float32. Stacked experts reach the quantizer one expert at a
    time, never as a float32 stack, so the largest transient is a few times one expert's or one
    checkpoint tensor's float32 size besides the array being yielded."""
    from ..quant import quantize_params

    dtypes = {**param_dtypes, **{name: "float32" for name in plan}}
    return quantize_params(convert(convs, ckpt, dtypes, blockwise=plan), plan)


def _export(
    cfg: DeepseekV2Config, target, quant: Quantization, options: BuildOptions | None = None
) -> tuple:
    """The traced (and for INT4, rewritten) model: (IRModule, named params, quantization plan)."""
    from ..model.deepseek_v2 import DeepseekV2ForCausalLM
    from ..model.kv_cache import KVFormat
    from ..quant.mutator import quantize_model

    options = options or BuildOptions()
    kv = KVFormat(options.kv_dtype, options.kv_scale)
    model = DeepseekV2ForCausalLM(cfg, quant.dtype, target, kv)
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
    from .tvm_log import benign_tvm_lines_hidden

    with tempfile.TemporaryDirectory() as work:
        # the shim first: a missing C++ compiler fails before minutes of codegen
        addons = [str(build_cublas_shim(work))] if options.gemm == "cublas" else []
        codegen = cuda_codegen() if device == "cuda" else contextlib.nullcontext()
        # the nvcc callback reads its -arch from Target.current(); TVM's benign warnings hidden
        with target, codegen, benign_tvm_lines_hidden():
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
        kv_dtype=options.kv_dtype,
        kv_scale=options.kv_scale,
        files=file_records(tmp),  # what the runtime checks before loading (runtime/integrity.py)
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
    kv_dtype: str | None = None,
    kv_scale: float | None = None,
) -> CompileResult:
    """Compile from a ``config.json`` alone (a file or the folder holding it), for benchmarks.

    The build has no converted weights: its library carries fill kernels and ``OUT/random-params
    .json`` says how to fill every parameter, so the runtime creates deterministic random weights
    on the device at load time (``Engine(OUT, random_weights=SEED)``; see
    :mod:`dsv2_mlc.runtime.random_params`). Options as :func:`compile_model`.
    """
    from ..layout import init_spec, write_spec
    from .random_fill import add_fill_kernels

    start = time.perf_counter()
    quant = _resolve_quantization(dtype, quantization, quantize_embedding, quantize_lm_head)
    kv = _kv_format(kv_dtype, kv_scale, quant.dtype)
    options = _build_options(device, arch, pdl, gemm, kv)
    out_dir = Path(out_dir).resolve()
    _check_out_dir(out_dir, (Path(config),), dump_ir)
    cfg = DeepseekV2Config.from_file(config)
    target = make_target(device, arch)

    with staged_dir(out_dir, _check_out_dir) as tmp:
        mod, named_params, _ = _export(cfg, target, quant, options)
        mod = add_fill_kernels(mod, (quant.dtype, "float32"))
        _compile_library(mod, target, device, tmp, dump_ir, options)
        spec = init_spec((name, p.shape, p.dtype) for name, p in named_params)
        write_spec(tmp, spec)
        names = [p.name for p in spec]
        build = _write_build_config(cfg, quant, device, target, names, tmp, options)
    return CompileResult(out_dir, build, time.perf_counter() - start)


# what a build writes besides its params/ (whose files its index lists): nothing else may be in a
# folder that compile replaces, so it never deletes what a user put there
_BUILD_FILES = frozenset((BUILD_CONFIG, LIBRARY, SPEC_FILE, *TOKENIZER_FILES))
_PARAMS_INDEX = "tensor-cache.json"  # written by tvmjs.dump_tensor_cache, with its shards
_PARAMS_EXTRA = ("tensor-cache-b16.json",)  # the same writer's record of bfloat16 tensors
_LISTED = 8  # unexpected entries named in a refusal


def foreign_entries(out_dir: Path) -> list[str]:
    """The entries of the folder ``out_dir`` that no build writes (``params/X`` inside params/,
    a trailing ``/`` for folders): replacing ``out_dir`` would delete them."""
    found = []
    for entry in sorted(out_dir.iterdir()):
        if entry.is_symlink():
            found.append(entry.name)
        elif entry.name == PARAMS_DIR and entry.is_dir():
            found += [f"{PARAMS_DIR}/{name}" for name in _foreign_params(entry)]
        elif entry.name not in _BUILD_FILES or not entry.is_file():
            found.append(entry.name + ("/" if entry.is_dir() else ""))
    return found


def _foreign_params(params: Path) -> list[str]:
    """The entries of a build's params/ that its index does not list (all, if it has none)."""
    listed = {_PARAMS_INDEX, *_PARAMS_EXTRA}
    try:
        index = json.loads((params / _PARAMS_INDEX).read_text())
        listed |= {str(record["dataPath"]) for record in index["records"]}
    except (OSError, ValueError, KeyError, TypeError):
        listed = set()  # no readable index: nothing in it is known to be the build's
    return [
        entry.name + ("/" if entry.is_dir() else "")
        for entry in sorted(params.iterdir())
        if entry.name not in listed or entry.is_symlink() or not entry.is_file()
    ]


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _check_out_dir(
    out_dir: Path, inputs: tuple[Path, ...] = (), dump_ir: str | Path | None = None
) -> None:
    """Refuse, before any work, an ``out_dir`` whose replacement would delete something that is
    not an earlier build's: an ``inputs`` path or the ``dump_ir`` folder inside it, a file, a
    folder that is not a build, or a build holding entries a build does not write."""
    for path in inputs:
        if _inside(path, out_dir):
            raise CompileError(
                f"{path} is inside the output folder {out_dir}, which the build replaces (so "
                "it would be deleted); choose an output folder outside it"
            )
    if dump_ir is not None and _inside(Path(dump_ir), out_dir):
        raise CompileError(
            f"--dump-ir {dump_ir} is inside the output folder {out_dir}, which the build "
            "replaces (so the dump would be deleted); write the dump to a folder outside it"
        )
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise CompileError(f"{out_dir}: exists and is not a folder; choose another output path")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not (out_dir / BUILD_CONFIG).is_file():
        raise CompileError(
            f"{out_dir}: folder is not empty and is not a dsv2-mlc build (no {BUILD_CONFIG}), "
            "and compiling would replace it; choose a new or empty output folder"
        )
    foreign = foreign_entries(out_dir)
    if foreign:
        more = f" and {len(foreign) - _LISTED} more" if len(foreign) > _LISTED else ""
        raise CompileError(
            f"{out_dir}: holds an earlier build and {', '.join(foreign[:_LISTED])}{more}, which "
            "a build does not write; compiling replaces the folder and would delete them: choose "
            "another output folder, or move them out first"
        )
