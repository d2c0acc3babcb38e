"""Can this machine run an artifact? Host platform, CUDA GPUs (through the driver, no torch), and
the installed tvm-ffi, compared with what the manifest says.

The GPU query calls ``libcuda.so.1`` directly with ``ctypes`` (``cuInit``, ``cuDriverGetVersion``,
``cuDeviceGetAttribute`` for the compute capability), so it needs only the NVIDIA driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import platform
import re
import sys
from dataclasses import dataclass

from .errors import RuntimeVersionError, TargetMismatchError
from .manifest import Manifest, Target

_MACHINES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv8": "aarch64"}
_ELF_MACHINES = {3: "i386", 62: "x86_64", 183: "aarch64", 243: "riscv64", 21: "ppc64"}
_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{MAJOR,MINOR}


def normalize_machine(machine: str) -> str:
    """``x86_64``/``aarch64`` whatever the platform calls them (``AMD64``, ``arm64``)."""
    m = machine.lower()
    return _MACHINES.get(m, m)


def host_os() -> str:
    """``linux``, ``darwin``, ``win32``, ... (``sys.platform`` without a version suffix)."""
    return re.sub(r"\d+$", "", sys.platform)


def host_machine() -> str:
    """This machine's architecture, normalised (``x86_64``, ``aarch64``)."""
    return normalize_machine(platform.machine())


def elf_machine(data: bytes) -> str:
    """The architecture of an ELF shared library from its header (``x86_64``, ``aarch64``)."""
    if data[:4] != b"\x7fELF" or len(data) < 20:
        raise ValueError("not an ELF file")
    order = "little" if data[5] == 1 else "big"
    code = int.from_bytes(data[18:20], order)
    return _ELF_MACHINES.get(code, f"elf-{code}")


@dataclass(frozen=True)
class CudaInfo:
    """What the NVIDIA driver reports: its CUDA version (13000 = 13.0) and each GPU's
    compute capability as ``(major, minor)``."""

    driver_version: int
    capabilities: tuple[tuple[int, int], ...]


def detect_cuda() -> CudaInfo | None:
    """The driver's view of this machine's GPUs, or ``None`` without a usable CUDA driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    try:
        if cuda.cuInit(0) != 0:
            return None
        version, count = ctypes.c_int(0), ctypes.c_int(0)
        cuda.cuDriverGetVersion(ctypes.byref(version))
        if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return None
        caps = []
        for i in range(count.value):
            dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
            if cuda.cuDeviceGet(ctypes.byref(dev), i) != 0:
                continue
            cuda.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, dev)
            cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, dev)
            caps.append((major.value, minor.value))
    except AttributeError:  # not a real driver (a build-time stub exports only a few symbols)
        return None
    return CudaInfo(version.value, tuple(caps))


def _arch_numbers(arch: str) -> tuple[int, int]:
    m = re.fullmatch(r"sm_(\d+?)(\d)a?", arch)
    if not m:
        raise TargetMismatchError(f"unknown CUDA architecture {arch!r} in the artifact manifest")
    return int(m.group(1)), int(m.group(2))


def check_target(target: Target, cuda: CudaInfo | None = None, *, probe: bool = True) -> None:
    """Raise :class:`TargetMismatchError` unless this machine can run an artifact for
    ``target``. ``cuda`` is the driver's report (queried when ``None`` and ``probe``)."""
    here = f"{host_os()}/{host_machine()}"
    if (target.os, normalize_machine(target.machine)) != (host_os(), host_machine()):
        raise TargetMismatchError(
            f"the artifact is built for {target.os}/{target.machine}, this machine is {here}; "
            f"pull the artifact built for {here} (see dist/index.json) or package one here"
        )
    if target.device == "cpu":
        return
    if target.device != "cuda":
        raise TargetMismatchError(
            f"the artifact targets device {target.device!r}, which this dsv2-mlc cannot run; "
            "upgrade dsv2-mlc"
        )
    want = target.cuda_arch or "sm_?"
    major, minor = _arch_numbers(want)
    if cuda is None and probe:
        cuda = detect_cuda()
    if cuda is None or not cuda.capabilities:
        raise TargetMismatchError(
            f"the artifact is built for CUDA GPUs ({want}), and this machine has no usable CUDA "
            "driver or GPU (libcuda.so.1); pull the cpu artifact instead, or run on a machine "
            f"with an NVIDIA GPU of compute capability {major}.{minor}"
        )
    if target.cuda_runtime and cuda.driver_version // 1000 < target.cuda_runtime:
        have = f"{cuda.driver_version // 1000}.{cuda.driver_version % 1000 // 10}"
        raise TargetMismatchError(
            f"the artifact bundles CUDA {target.cuda_runtime} runtime, and this machine's NVIDIA "
            f"driver supports CUDA {have} only; upgrade the NVIDIA driver (CUDA "
            f"{target.cuda_runtime} needs driver 580 or newer)"
        )
    # Kernel binaries for sm_XY run on compute capability X.Z with Z >= Y (same major).
    if not any(cap[0] == major and cap[1] >= minor for cap in cuda.capabilities):
        found = ", ".join(f"sm_{a}{b}" for a, b in cuda.capabilities)
        raise TargetMismatchError(
            f"the artifact's kernels are built for {want}, and this machine's GPUs are {found}; "
            f"pull (or package) an artifact built for {found.split(', ')[0]}"
        )


def installed_tvm_ffi_version() -> str | None:
    """The installed apache-tvm-ffi version (package metadata, else ``tvm_ffi.__version__``)."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version("apache-tvm-ffi")
    try:
        import tvm_ffi
    except ImportError:
        return None
    return str(getattr(tvm_ffi, "__version__", "")) or None


def check_runtime(manifest: Manifest, ffi_version: str | None = None) -> None:
    """Raise :class:`RuntimeVersionError` unless the installed tvm-ffi (and, when TVM is already
    loaded in this process, TVM) is the version the artifact was built with."""
    have = ffi_version if ffi_version is not None else installed_tvm_ffi_version()
    want = manifest.tvm_ffi_version
    if have != want:
        raise RuntimeVersionError(
            f"artifact {manifest.name} was built with apache-tvm-ffi {want}, and this Python has "
            f"{have or 'none'}; run `pip install apache-tvm-ffi=={want}` (or pull an artifact "
            "built for your version)"
        )
    tvm = sys.modules.get("tvm")
    loaded = getattr(tvm, "__version__", None)
    if loaded is not None and loaded != manifest.tvm_version:
        raise RuntimeVersionError(
            f"artifact {manifest.name} needs the TVM {manifest.tvm_version} runtime, and this "
            f"process already loaded TVM {loaded} (import tvm); open it in a process that does "
            f"not import tvm, or install apache-tvm=={manifest.tvm_version}"
        )
    if not manifest.runtime_libs:
        installed = _installed_tvm_version()
        if installed is not None and installed != manifest.tvm_version:
            raise RuntimeVersionError(
                f"artifact {manifest.name} bundles no TVM runtime and needs TVM "
                f"{manifest.tvm_version}, and apache-tvm {installed} is installed; run "
                f"`pip install apache-tvm=={manifest.tvm_version}`"
            )


def _installed_tvm_version() -> str | None:
    for dist in ("apache-tvm", "tvm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def check_compatible(manifest: Manifest) -> None:
    """Target and runtime checks together (what pull and open run)."""
    check_target(manifest.target)
    check_runtime(manifest)
