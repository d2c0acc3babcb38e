"""InsertGridDependencyControl: every CUDA kernel waits with ``griddepcontrol.wait`` (PDL) before
it reads what earlier kernels wrote: first thing, unless it places the wait itself."""

from __future__ import annotations

import re

import tvm
from tvm import tirx
from tvm.backend.cuda.op import cuda_func_call

from ..schedules.cuda_call import GRID_WAIT, grid_wait_source

WAIT = GRID_WAIT
_KERNEL_LAUNCH = 2  # CallingConv::kDeviceKernelLaunch: a __global__ function after SplitHostDevice


def _call(name: str, source: str) -> tirx.Stmt:
    return tirx.Evaluate(cuda_func_call(name, source_code=source))


def waits_itself(func: tirx.PrimFunc) -> bool:
    """Whether ``func``'s body calls a hand CUDA device function whose source calls the wait
    (:func:`dsv2_mlc.schedules.cuda_call.grid_wait_source`) itself, after its weight loads (the
    source is a string argument of the ``T.cuda.func_call``: it shows in the printed body)."""
    return f"{WAIT}();" in func.script()


def is_cuda_kernel(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` is a CUDA ``__global__`` kernel of a host/device-split module."""
    attrs = func.attrs
    if attrs is None or "calling_conv" not in attrs or "target" not in attrs:
        return False
    return int(attrs["calling_conv"]) == _KERNEL_LAUNCH and attrs["target"].kind.name == "cuda"


def InsertGridDependencyControl() -> tvm.transform.Pass:
    """Prepend ``griddepcontrol.wait`` (sm_90+) to every CUDA kernel of a device module that
    does not call it itself (:func:`waits_itself`: a hand kernel that loads its weights first).

    Run it on device modules after ``SplitHostDevice`` (e.g. in the TIR pipeline's device
    finalisation), where the kernels are separate functions. The wait blocks until the grids this
    one programmatically depends on have completed and their writes are visible; without such a
    dependency (a plain launch or graph edge) it returns at once. Being first in the kernel, it
    precedes every read of a predecessor's output, so a programmatic graph edge into the kernel
    is safe whatever the kernel does. TVM's kernels release their dependents at their exit; the
    hand kernels that wait themselves release them right after their wait
    (:data:`~dsv2_mlc.schedules.cuda_call.WAIT_THEN_RELEASE`). TVM's kernels do not release after
    the inserted wait: that makes a decode graph's replay no faster
    (schedules/results/decode_kernels.md)."""

    @tirx.transform.prim_func_pass(opt_level=0, name="InsertGridDependencyControl")
    def insert(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx) -> tirx.PrimFunc:  # noqa: ANN001
        if not is_cuda_kernel(func):
            return func
        if waits_itself(func):
            return func
        return func.with_body(tirx.SeqStmt([_call(WAIT, grid_wait_source()), func.body]))

    return insert


_KERNEL_DEF = re.compile(
    r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\([^;{]*\)\s*\{"
)


_DEVICE_DEF = re.compile(r"__device__\s+(?:__forceinline__\s+)?void\s+(\w+)\([^;{]*\)\s*\{")


def _waiting_device_functions(cuda_source: str) -> set[str]:
    """Names of the ``__device__`` functions of ``cuda_source`` whose body calls the wait (a
    body runs to the next function definition)."""
    starts = sorted(
        [(m.start(), m.end(), m.group(1)) for m in _DEVICE_DEF.finditer(cuda_source)]
        + [(m.start(), m.end(), None) for m in _KERNEL_DEF.finditer(cuda_source)]
    )
    names = set()
    for i, (_, end, name) in enumerate(starts):
        stop = starts[i + 1][0] if i + 1 < len(starts) else len(cuda_source)
        if name not in (None, WAIT) and f"{WAIT}();" in cuda_source[end:stop]:
            names.add(name)
    return names


def kernels_without_wait(cuda_source: str) -> tuple[list[str], list[str]]:
    """(every ``__global__`` function defined in ``cuda_source``, those that neither start with
    the ``griddepcontrol.wait`` call this pass inserts nor call a device function that waits
    itself: a hand kernel that issues its weight loads first)."""
    waiting = _waiting_device_functions(cuda_source)
    calls = re.compile(r"\b(" + "|".join(sorted(waiting)) + r")\(") if waiting else None
    defs = list(_KERNEL_DEF.finditer(cuda_source))
    kernels, missing = [], []
    for i, match in enumerate(defs):
        kernels.append(match.group(1))
        body = cuda_source[match.end() : defs[i + 1].start() if i + 1 < len(defs) else None]
        if body.lstrip().startswith(f"{WAIT}();") or (calls and calls.search(body)):
            continue
        missing.append(match.group(1))
    return kernels, missing
