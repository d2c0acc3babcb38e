"""A PrimFunc that launches a hand-written CUDA device function over a grid of blocks per token.

The decode kernels written as CUDA source (``moe_decode_cuda``, ``norm_gemv_cuda``) share one TIR
shell: buffers of ``n`` tokens (``n`` dynamic) and fixed-shape weights, a grid of
``n * blocks_per_token`` blocks of ``threads`` threads, and in it one ``T.cuda.func_call`` of the
device function with a pointer to each buffer, then the token ``bx // blocks_per_token``, the
block of the token and the thread. :func:`token_grid_call` builds that shell.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import DataType, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

__all__ = [
    "GRID_WAIT",
    "LAUNCH_DEPENDENTS",
    "L2_PREFETCH",
    "RELEASE_THEN_WAIT",
    "WAIT_THEN_RELEASE",
    "TOKENS",
    "buffer_dims",
    "grid_wait_source",
    "launch_dependents_source",
    "l2_prefetch_source",
    "token_grid_call",
]

TOKENS = None  # in a buffer shape: the dynamic number of tokens ``n``

GRID_WAIT = "dsv2_griddepcontrol_wait"  # the device function a kernel calls to wait (PDL)
LAUNCH_DEPENDENTS = "dsv2_griddepcontrol_launch_dependents"  # ... to release its dependents
# What a hand kernel's CUDA source calls after issuing its weight loads (grid_wait_source).
WAIT_THEN_RELEASE = f"{GRID_WAIT}();\n  {LAUNCH_DEPENDENTS}();"
# What a kernel with nothing to load before its wait may call instead: its dependents' launch and
# their pre-wait loads then overlap this kernel's wait too (grid_wait_source says when it is safe).
RELEASE_THEN_WAIT = f"{LAUNCH_DEPENDENTS}();\n  {GRID_WAIT}();"
L2_PREFETCH = "dsv2_l2_prefetch"  # the device function that asks for bytes in L2


def grid_wait_source() -> str:
    """CUDA: ``dsv2_griddepcontrol_wait()``, Programmatic Dependent Launch's ``griddepcontrol
    .wait`` (sm_90+; a no-op when compiled for older GPUs, which have no programmatic launches).

    It blocks the calling thread until the grids this one programmatically depends on have
    completed and their writes are visible, and returns at once without such a dependency (an
    ordinary launch or graph edge). ``passes/grid_dependency_control.py`` puts it first in every
    kernel of a ``--pdl`` build; a hand kernel may call it itself, after issuing the loads of
    what no earlier kernel writes (its weights), so that those overlap the previous kernel: the
    pass then leaves that kernel alone. Before its wait a kernel must neither read what a
    predecessor writes nor write anything.

    Also ``dsv2_griddepcontrol_launch_dependents()`` (``griddepcontrol.launch_dependents``, a
    no-op before sm_90): the next kernel of a programmatic edge may be launched once every block
    of this one has called it or exited, instead of once all have exited. The model's hand
    kernels call it right after their wait (:data:`WAIT_THEN_RELEASE`; the lab-only variants
    do not), so the next kernel's blocks take the SM room this kernel's blocks leave and issue
    their own weight loads while it runs, which shortens a decode graph's replay
    (schedules/results/decode_kernels.md; releasing TVM's kernels too, or the MoE kernels only
    after their last loads, gains less). Since a kernel releases only after its wait, a
    kernel's pre-wait code runs only once the kernel two launches back has completed.

    A kernel may also release *before* its wait (:data:`RELEASE_THEN_WAIT`, the KV append of
    ``mla_append_cuda``): its successor is then launched as soon as this kernel's blocks have
    started, and the successor's pre-wait code overlaps this kernel's wait on its own
    predecessor. That stays safe because pre-wait code reads only what no kernel of the step
    writes (weights, the runtime's page tables) and writes nothing, and the successor's wait
    returns only once this kernel has completed, hence once this kernel's wait has returned."""
    return (
        f"#ifndef DSV2_GRID_WAIT\n#define DSV2_GRID_WAIT\n"
        f"__forceinline__ __device__ void {GRID_WAIT}() {{\n"
        "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n"
        '  asm volatile("griddepcontrol.wait;" ::: "memory");\n'
        "#endif\n}\n#endif\n"
    ) + launch_dependents_source()


def launch_dependents_source() -> str:
    """CUDA: ``dsv2_griddepcontrol_launch_dependents()`` alone (:func:`grid_wait_source` has it
    too), for ``passes/grid_dependency_control.py``'s release in TVM's kernels."""
    return (
        f"#ifndef DSV2_LAUNCH_DEPENDENTS\n#define DSV2_LAUNCH_DEPENDENTS\n"
        f"__forceinline__ __device__ void {LAUNCH_DEPENDENTS}() {{\n"
        "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n"
        '  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n'
        "#endif\n}\n#endif\n"
    )


def l2_prefetch_source() -> str:
    """CUDA: ``dsv2_l2_prefetch(p, bytes)``, a bulk prefetch of ``[p, p + bytes)`` into L2
    (``cp.async.bulk.prefetch.L2``, sm_90+: one instruction for a whole weight row or KV page,
    handled by the copy engine; ``p`` 16-byte aligned, ``bytes`` a multiple of 16; a no-op on
    older GPUs; the tests' CPU emulation checks and counts it).

    Nothing waits for it and it returns nothing: it only warms L2, which is where global memory
    is coherent, so it is safe on any address at any time: before ``griddepcontrol.wait``, on a
    page the previous kernel is still writing (the later read sees the write), or on weights a
    later kernel reads. A kernel uses it for what it will read from HBM anyway once its wait
    returns (KV pages), or on behalf of the next kernel (the routed experts' down rows, known
    only after routing)."""
    return (
        f"#ifndef DSV2_L2_PREFETCH\n#define DSV2_L2_PREFETCH\n"
        f"__forceinline__ __device__ void {L2_PREFETCH}(const void* p, unsigned bytes) {{\n"
        "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n"
        '  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"\n'
        '               :: "l"(__cvta_generic_to_global(p)), "r"(bytes) : "memory");\n'
        "#elif defined(DSV2_EMULATION)\n  dsv2_emu_l2_prefetch(p, bytes);\n"
        "#endif\n}\n#endif\n"
    )


Param = tuple[str, Sequence[int | None], str]  # (name, shape with TOKENS for n, dtype)


def buffer_dims(
    func: tirx.PrimFunc, params: Sequence[tuple[str, int]]
) -> list[list[int | None]] | None:
    """The dims of ``func``'s buffer parameters (None for a symbolic one, such as the tokens)
    if they are, in order, of the dtypes and ranks ``params``; else None. The rules that swap a
    tagged TE for a hand kernel match its signature with it."""
    if len(func.params) != len(params):
        return None
    dims = []
    for buf, (dtype, rank) in zip(func.params, params, strict=True):
        if str(buf.dtype) != dtype or len(buf.shape) != rank:
            return None
        dims.append([int(d) if isinstance(d, tirx.IntImm) else None for d in buf.shape])
    return dims


def token_grid_call(
    block: str,
    fname: str,
    source: str,
    params: Sequence[Param],
    blocks_per_token: int,
    threads: int,
    per_token: bool = True,
    dyn_shared_bytes: int = 0,
    min_blocks: int = 0,
    dyn_dtype: str = "uint32",
) -> tirx.PrimFunc:
    """``f(*params)``: ``n * blocks_per_token`` blocks of ``threads`` threads, each calling
    ``fname(&params[0][0...], ..., token, block_of_token, thread)`` from ``source`` (module
    docstring). A buffer whose shape holds ``TOKENS`` takes ``n`` there. With ``per_token``
    False the grid is ``blocks_per_token`` blocks whatever ``n``, and the call is ``fname(...,
    n, block, thread)``: the kernel loops over the tokens itself (reading its weights once).
    ``dyn_shared_bytes`` > 0 gives the block that much dynamic shared memory (TVM's launcher opts
    in past 48 KB), passed as an ``unsigned*`` (16-byte aligned) right after the buffers,
    followed by a pointer to its last word (for TVM, unused); as ``dyn_dtype`` elements (TVM
    declares one ``extern __shared__`` array for every kernel of a module: kernels that share a
    module with the float16 ``shared.dyn`` of the attention and grouped GEMM kernels take
    ``"float16"``). Without a ``TOKENS`` dimension
    (fixed shapes; ``per_token`` must be False) the call gets 0 for ``n``. ``min_blocks`` > 0
    asks for ``__launch_bounds__(threads, min_blocks)`` (ptxas caps the registers so that many
    blocks fit an SM)."""
    has_tokens = any(d is TOKENS for _, shape, _ in params for d in shape)
    if not has_tokens and per_token:
        raise ValueError("a grid per token needs a buffer with a TOKENS dimension")
    with IRBuilder() as ib:
        with Tb.prim_func(private=True, s_tir=True):
            Tb.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            n = tirx.Var("n", "int64")
            bufs = []
            for name, shape, dtype in params:
                handle = Tb.arg(f"var_{name}", Tb.handle())
                dims = [n if d is TOKENS else d for d in shape]
                bufs.append(Tb.match_buffer(handle, dims, dtype))
                IRBuilder.name(name, bufs[-1])
            grid = n * blocks_per_token if per_token else blocks_per_token
            with Tb.thread_binding(grid, thread="blockIdx.x") as bx:
                IRBuilder.name("bx", bx)
                with Tb.thread_binding(threads, thread="threadIdx.x") as tx:
                    IRBuilder.name("tx", tx)
                    with Tb.sblock(block):
                        Tb.reads()
                        Tb.writes()
                        pointers = [T.address_of(b[tuple(0 for _ in b.shape)]) for b in bufs]
                        if dyn_shared_bytes:
                            per16 = 128 // DataType(dyn_dtype).bits  # elements in 16 bytes
                            words = -(-dyn_shared_bytes // 16) * per16
                            smem = Tb.sblock_alloc_buffer((words,), dyn_dtype, scope="shared.dyn")
                            IRBuilder.name("smem", smem)
                            # the last word's address too (unused by the callee): TVM compacts a
                            # block's buffer to the region its TIR touches
                            pointers += [T.address_of(smem[0]), T.address_of(smem[words - 1])]
                        call = T.cuda.func_call(
                            fname,
                            *pointers,
                            bx // blocks_per_token
                            if per_token
                            else (n if has_tokens else T.int64(0)),
                            T.cast(bx % blocks_per_token if per_token else bx, "int32"),
                            T.cast(tx, "int32"),
                            source_code=source,
                        )
                        if min_blocks:
                            with Tb.attr(0, "tirx.launch_bounds_min_blocks_per_sm", min_blocks):
                                Tb.evaluate(call)
                        else:
                            Tb.evaluate(call)
    return ib.get()
