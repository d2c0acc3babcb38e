"""A PrimFunc that launches a hand-written CUDA device function over a grid of blocks per token.

The decode kernels written as CUDA source (``moe_decode_cuda``, ``norm_gemv_cuda``) share one TIR
shell: buffers of ``n`` tokens (``n`` dynamic) and fixed-shape weights, a grid of
``n * blocks_per_token`` blocks of ``threads`` threads, and in it one ``T.cuda.func_call`` of the
device function with a pointer to each buffer, then the token ``bx // blocks_per_token``, the
block of the token and the thread. :func:`token_grid_call` builds that shell.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

__all__ = ["TOKENS", "token_grid_call"]

TOKENS = None  # in a buffer shape: the dynamic number of tokens ``n``

Param = tuple[str, Sequence[int | None], str]  # (name, shape with TOKENS for n, dtype)


def token_grid_call(
    block: str,
    fname: str,
    source: str,
    params: Sequence[Param],
    blocks_per_token: int,
    threads: int,
) -> tirx.PrimFunc:
    """``f(*params)``: ``n * blocks_per_token`` blocks of ``threads`` threads, each calling
    ``fname(&params[0][0...], ..., token, block_of_token, thread)`` from ``source`` (module
    docstring). A buffer whose shape holds ``TOKENS`` takes ``n`` there."""
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
            with Tb.thread_binding(n * blocks_per_token, thread="blockIdx.x") as bx:
                IRBuilder.name("bx", bx)
                with Tb.thread_binding(threads, thread="threadIdx.x") as tx:
                    IRBuilder.name("tx", tx)
                    with Tb.sblock(block):
                        Tb.reads()
                        Tb.writes()
                        pointers = [T.address_of(b[tuple(0 for _ in b.shape)]) for b in bufs]
                        Tb.evaluate(
                            T.cuda.func_call(
                                fname,
                                *pointers,
                                bx // blocks_per_token,
                                T.cast(bx % blocks_per_token, "int32"),
                                T.cast(tx, "int32"),
                                source_code=source,
                            )
                        )
    return ib.get()
