"""InsertGridDependencyControl: every CUDA kernel starts with ``griddepcontrol.wait`` (PDL)."""

from __future__ import annotations

import re

import tvm
from tvm import tirx
from tvm.backend.cuda.op import cuda_func_call

WAIT = "dsv2_griddepcontrol_wait"
LAUNCH_DEPENDENTS = "dsv2_griddepcontrol_launch_dependents"
_SOURCE = (
    "__forceinline__ __device__ void {name}() "
    '{{ asm volatile("griddepcontrol.{action};" ::: "memory"); }}\n'
)
_KERNEL_LAUNCH = 2  # CallingConv::kDeviceKernelLaunch: a __global__ function after SplitHostDevice


def _call(name: str, action: str) -> tirx.Stmt:
    source = _SOURCE.format(name=name, action=action)
    return tirx.Evaluate(cuda_func_call(name, source_code=source))


def is_cuda_kernel(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` is a CUDA ``__global__`` kernel of a host/device-split module."""
    attrs = func.attrs
    if attrs is None or "calling_conv" not in attrs or "target" not in attrs:
        return False
    return int(attrs["calling_conv"]) == _KERNEL_LAUNCH and attrs["target"].kind.name == "cuda"


def InsertGridDependencyControl(launch_dependents: bool = False) -> tvm.transform.Pass:
    """Prepend ``griddepcontrol.wait`` (sm_90+) to every CUDA kernel of a device module.

    Run it on device modules after ``SplitHostDevice`` (e.g. in the TIR pipeline's device
    finalisation), where the kernels are separate functions. The wait blocks until the grids this
    one programmatically depends on have completed and their writes are visible; without such a
    dependency (a plain launch or graph edge) it returns at once. Being first in the kernel, it
    precedes every read of a predecessor's output, so a programmatic graph edge into the kernel
    is safe whatever the kernel does. ``launch_dependents`` adds ``griddepcontrol
    .launch_dependents`` right after the wait: the next kernel may then be launched once all of
    this kernel's blocks have started (its blocks sit on SM slots in their own wait until this
    kernel completes), instead of once they have all exited."""

    @tirx.transform.prim_func_pass(opt_level=0, name="InsertGridDependencyControl")
    def insert(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx) -> tirx.PrimFunc:  # noqa: ANN001
        if not is_cuda_kernel(func):
            return func
        prologue = [_call(WAIT, "wait")]
        if launch_dependents:
            prologue.append(_call(LAUNCH_DEPENDENTS, "launch_dependents"))
        return func.with_body(tirx.SeqStmt([*prologue, func.body]))

    return insert


_KERNEL_DEF = re.compile(
    r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\([^;{]*\)\s*\{"
)


def kernels_without_wait(cuda_source: str) -> tuple[list[str], list[str]]:
    """(every ``__global__`` function defined in ``cuda_source``, those whose first statement is
    not the ``griddepcontrol.wait`` call this pass inserts)."""
    kernels, missing = [], []
    for match in _KERNEL_DEF.finditer(cuda_source):
        kernels.append(match.group(1))
        if not cuda_source[match.end() :].lstrip().startswith(f"{WAIT}();"):
            missing.append(match.group(1))
    return kernels, missing
