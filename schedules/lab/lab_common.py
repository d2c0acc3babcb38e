"""Plumbing shared by the kernel labs (``schedules/lab/kernel_lab_*.py``), imported as a sibling
module.

Build side (``prepare``, build box with TVM + nvcc, no GPU): TIR-only libraries for CUDA
(:func:`tir_module`, :func:`apply_dlight`, :func:`compile_cuda_library`,
:func:`build_libraries`) and the manifest (:func:`manifest_header`, :func:`write_manifest`).
GPU side (``run``: torch, ``tvm_ffi`` and TVM's runtime libraries only): loading the runtime and
the lab libraries (:func:`load_tvm_runtime`, :func:`load_kernels`, :func:`ffi_tensors`) and
CUDA-event timing (:func:`wall_seconds`, :func:`loop_counts`, :func:`event_median`,
:func:`time_call`, :func:`graph_seconds`) and CUPTI kernel times (:func:`cupti_seconds`).
Both: the command line every lab starts from (:func:`lab_parser`, :func:`add_case_options`).

Nothing here imports tvm at module level (the GPU box has no tvm): only the build functions do;
torch is passed in by the callers, as the labs do.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_LIBRARIES = ("libtvm_runtime.so", "libtvm_runtime_cuda.so")


# -- here: builds ----------------------------------------------------------------------------------
def tir_module(funcs: Mapping[str, Any]) -> Any:  # -> tvm.IRModule
    """An IRModule of ``symbol -> PrimFunc``, each function exported under its symbol."""
    import tvm

    return tvm.IRModule({s: f.with_attr("global_symbol", s) for s, f in funcs.items()})


def apply_dlight(mod: Any, target: Any) -> Any:  # -> tvm.IRModule
    """``mod`` scheduled by dlight's default GPU rules, as the pipeline applies them
    (``passes/pipeline.py``: Matmul, GEMV, Reduction, GeneralReduction, Fallback)."""
    from tvm.s_tir import dlight as dl

    with target:
        return dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(),
            dl.gpu.GEMV(),
            dl.gpu.Reduction(),
            dl.gpu.GeneralReduction(),
            dl.gpu.Fallback(),
        )(mod)


def compile_cuda_library(
    mod: Any, path: Path, arch: str, target: Any, arch_specific: bool = True
) -> None:
    """Compile the TIR-only ``mod`` for CUDA (precompiled fatbins, ``cuda_codegen``, with the
    arch-specific features unless ``arch_specific=False``), export it to ``path`` and check that
    the library embeds ``arch`` machine code (``check_fatbin``)."""
    import tvm

    from dsv2_mlc.compiler.cuda import check_fatbin, cuda_codegen

    with cuda_codegen(arch_specific), target:
        exe = tvm.compile(mod, target=target)
    exe.export_library(str(path))
    check_fatbin(path, arch)


def fresh_lab_dir(lab_dir: Path, stale: str) -> None:
    """Create ``lab_dir`` if needed and remove its libraries matching the glob ``stale``."""
    lab_dir.mkdir(parents=True, exist_ok=True)
    for old in lab_dir.glob(stale):
        old.unlink()


def _shown(path: Path) -> str:
    """``path`` relative to the repository root where it lies below it (for messages)."""
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def build_libraries(
    funcs: Mapping[str, Any],
    lab_dir: Path,
    prefix: str,
    arch: str,
    target: Any,
    kwargs: Mapping[str, object],
    baseline: str,
) -> dict[str, dict]:
    """One library per PrimFunc: ``<prefix>_<key>.so`` exporting ``<prefix>_<key>``.

    Returns the manifest's ``kernels``: ``key -> {"library", "symbol", "kwargs", "compile_s",
    "bytes"}``, where ``kwargs`` is ``kwargs[key]`` (a variant's keyword arguments) or
    ``baseline`` (the description of TVM's kernel) for keys not in ``kwargs``; prints one line a
    library.
    """
    built = {}
    for key, func in funcs.items():
        lib, symbol = f"{prefix}_{key}.so", f"{prefix}_{key}"
        mod = tir_module({symbol: func})
        start = time.time()
        compile_cuda_library(mod, lab_dir / lib, arch, target)
        built[key] = {
            "library": lib,
            "symbol": symbol,
            "kwargs": kwargs.get(key, baseline),
            "compile_s": round(time.time() - start, 1),
            "bytes": (lab_dir / lib).stat().st_size,
        }
        print(f"{key}: {_shown(lab_dir)}/{lib} ({built[key]['compile_s']} s)", flush=True)
    return built


def manifest_header(arch: str) -> dict:
    """The first entries of a lab manifest: ``commit`` (short HEAD), ``uncommitted`` (``git
    status --short`` lines), ``prepared`` (local time) and ``arch``."""

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout

    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "uncommitted": git("status", "--short").splitlines(),
        "prepared": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "arch": arch,
    }


def write_manifest(lab_dir: Path, manifest: dict) -> None:
    """Write ``lab_dir/manifest.json`` (indent 1)."""
    (lab_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))


def read_manifest(lab_dir: Path) -> dict:
    """The parsed ``lab_dir/manifest.json``."""
    return json.loads((lab_dir / "manifest.json").read_text())


# -- there: loading --------------------------------------------------------------------------------
def load_tvm_runtime(lib_dir: str, preload_ffi: bool = False) -> None:
    """Load TVM's runtime libraries from ``lib_dir`` (``RTLD_GLOBAL``), so that lab libraries
    load through ``tvm_ffi.load_module``.

    With ``preload_ffi``, first the ``libtvm_ffi.so`` of the ``tvm_ffi`` package, global:
    ``libtvm_runtime.so`` needs it (RUNPATH ``$ORIGIN`` only), and a stale or partial tvm_ffi
    install does not load it.
    """
    import tvm_ffi

    if preload_ffi:
        ffi_lib = Path(getattr(tvm_ffi, "__file__", None) or ".").parent / "lib" / "libtvm_ffi.so"
        if ffi_lib.exists():
            ctypes.CDLL(str(ffi_lib), mode=ctypes.RTLD_GLOBAL)
    for name in RUNTIME_LIBRARIES:
        ctypes.CDLL(str(Path(lib_dir) / name), mode=ctypes.RTLD_GLOBAL)


def load_kernels(lib_dir: str, lab_dir: Path, only: str | None) -> dict:
    """The functions of the manifest's ``kernels`` (``key -> {"library", "symbol", ...}``),
    ``key -> function``, after :func:`load_tvm_runtime`; ``only``: comma-separated keys."""
    import tvm_ffi

    load_tvm_runtime(lib_dir)
    built = read_manifest(lab_dir)["kernels"]
    keep = set(only.split(",")) if only else None
    return {
        key: tvm_ffi.load_module(str(lab_dir / k["library"]))[k["symbol"]]
        for key, k in built.items()
        if keep is None or key in keep
    }


def ffi_tensors(*tensors: Any) -> list:
    """``tensors`` (torch) as tvm_ffi tensors (DLPack, no copy)."""
    import tvm_ffi

    return [tvm_ffi.from_dlpack(t) for t in tensors]


# -- there: timing ---------------------------------------------------------------------------------
def wall_seconds(torch: Any, run: Callable[[], object]) -> float:
    """Wall-clock seconds of ``run()`` between two device synchronizations."""
    torch.cuda.synchronize()
    t0 = time.time()
    run()
    torch.cuda.synchronize()
    return time.time() - t0


def loop_counts(one: float, budget_s: float, max_inner: int, fill_s: float) -> tuple[int, int]:
    """(calls per timed loop, loops) for a call of ``one`` seconds: about ``fill_s`` seconds a
    loop (1 to ``max_inner`` calls), 3 to 9 loops within ``budget_s``."""
    inner = int(min(max_inner, max(1, fill_s / one)))
    loops = int(min(9, max(3, budget_s / (one * inner))))
    return inner, loops


def event_median(torch: Any, run_loop: Callable[[], object], calls: int, loops: int) -> float:
    """Median seconds per call over ``loops`` loops, each ``run_loop()`` (which makes ``calls``
    calls back to back) timed with CUDA events."""
    times = []
    for _ in range(loops):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_loop()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def time_call(torch: Any, func: Callable, args: list, budget_s: float) -> float:
    """Median seconds per call of ``func(*args)`` over loops of back-to-back calls (CUDA events;
    up to 50 calls, about 20 ms, a loop)."""
    one = max(wall_seconds(torch, lambda: func(*args)), 1e-6)
    inner, loops = loop_counts(one, budget_s, max_inner=50, fill_s=0.02)

    def run_loop() -> None:
        for _ in range(inner):
            func(*args)

    return event_median(torch, run_loop, inner, loops)


def graph_seconds(torch: Any, tvm_ffi: Any, calls: list[Callable[[], object]]) -> float | None:
    """Seconds per call of ``calls`` (repeated to about 64) replayed from one CUDA graph (the
    launches as in a captured decode step); None if the capture fails."""
    try:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        seq = calls * max(1, 64 // len(calls))
        with torch.cuda.stream(side), tvm_ffi.use_torch_stream():  # warm up on the side stream
            for f in seq[:4]:
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with tvm_ffi.use_torch_stream(torch.cuda.graph(g)):
            for f in seq:
                f()
        g.replay()
        torch.cuda.synchronize()

        def replay5() -> None:
            for _ in range(5):
                g.replay()

        return event_median(torch, replay5, 5 * len(seq), 7)
    except Exception as err:  # noqa: BLE001 - reported, the caller goes on without it
        print(f"  (graph capture failed: {str(err)[:100]})")
        return None


def cupti_seconds(torch: Any, calls: list[Callable[[], object]]) -> float | None:
    """Summed GPU duration of the kernels of one call (CUPTI, through ``torch.profiler``;
    launch gaps excluded), averaged over ``calls`` repeated to about 64; None if profiling
    fails."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        seq = calls * max(1, 64 // len(calls))
        for f in seq[:8]:
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for f in seq:
                f()
            torch.cuda.synchronize()
        us = [e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA]
        return sum(us) / 1e6 / len(seq) if us else None
    except Exception as err:  # noqa: BLE001 - reported, the caller goes on without it
        print(f"  (profiler failed: {str(err)[:100]})")
        return None


# -- command line ----------------------------------------------------------------------------------
def lab_parser(
    doc: str, prepare_help: str, run_help: str, lab_dir: Path | None = None
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """A lab's command line: (parser, ``prepare`` subparser, ``run`` subparser); the description
    is the first line of ``doc``. ``prepare`` has ``--arch`` (default sm_90); ``run`` has
    ``--lib-dir`` (TVM's runtime libraries; default ``$DSV2_MLC_TVM_LIB_DIR``, else where the
    runtime finds them) and ``--out`` (results folder; default ``$OUT``); with ``lab_dir`` both
    have ``--lab-dir`` (the libraries and manifest; that default). The lab adds its own options
    to the subparsers; ``args.cmd`` is the subcommand."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help=prepare_help)
    p.add_argument("--arch", default="sm_90")
    r = sub.add_parser("run", help=run_help)
    r.add_argument("--lib-dir", default=os.environ.get("DSV2_MLC_TVM_LIB_DIR"))
    r.add_argument("--out", default=os.environ.get("OUT"))
    if lab_dir is not None:
        for one in (p, r):
            one.add_argument("--lab-dir", default=str(lab_dir))
    return parser, p, r


def verdict(bad: list[str]) -> int:
    """Print whether every checked kernel was right (else the wrong or failed ones, each once)
    and return the lab's exit status."""
    print("all correct" if not bad else f"WRONG or failed: {sorted(set(bad))}")
    return 1 if bad else 0


def add_case_options(run: argparse.ArgumentParser, budget_per_case_s: float) -> None:
    """The ``run`` options of a lab of kernels x cases (MLA, prefill attention):
    ``--budget-per-case-s``, ``--only`` (comma-separated kernel names, for :func:`load_kernels`)
    and ``--cases`` (only cases whose name contains this)."""
    run.add_argument("--budget-per-case-s", type=float, default=budget_per_case_s)
    run.add_argument("--only", default=None, help="comma-separated kernel names")
    run.add_argument("--cases", default=None, help="only cases whose name contains this")
