"""Page-table arithmetic that every MLA attention kernel starts with (CPU and CUDA alike).

A query row finds its sequence in ``q_indptr`` by binary search, then the sequence's cached length
from its page count and last-page length, and how many keys the row sees (causal: the last
``q_len`` positions are the new tokens, so query ``r`` of the chunk sees ``kv_len - q_len + r + 1``
of them). Helpers for TVMScript kernels: :func:`find_sequence` is a macro over two ``int32``
scratch cells, the others build expressions.
"""

from __future__ import annotations

from tvm.script import tirx as T


@T.macro
def find_sequence(q_indptr, batch_size, row, lo, hi):
    """Leave in ``lo[0]`` the sequence ``b`` with ``q_indptr[b] <= row < q_indptr[b + 1]``."""
    lo[0] = 0
    hi[0] = batch_size
    while hi[0] - lo[0] > 1:
        if q_indptr[(lo[0] + hi[0]) // 2] <= row:
            lo[0] = (lo[0] + hi[0]) // 2
        else:
            hi[0] = (lo[0] + hi[0]) // 2


def kv_length(num_pages, last_page_len, page_size):  # (PrimExpr...) -> PrimExpr
    """Tokens cached for a sequence of ``num_pages`` pages whose last holds ``last_page_len``."""
    return T.if_then_else(num_pages > 0, (num_pages - 1) * page_size + last_page_len, 0)


def visible_length(kv_len, q_len, q_pos, causal):  # (PrimExpr...) -> PrimExpr
    """Keys query ``q_pos`` of a ``q_len``-row chunk sees (``causal > 0``: up to itself)."""
    return T.max(T.if_then_else(causal > 0, T.min(kv_len, kv_len - q_len + q_pos + 1), kv_len), 0)
