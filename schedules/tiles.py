"""The shipped kernels' tuned parameters, in one table keyed by kernel, architecture and shape.

A shipped kernel builder takes shapes and dtypes from its caller and everything else (tile
sizes, block counts, pipeline depths, launch options) from here, through :func:`tuned`. The
measurements behind each entry are in ``schedules/results/<kernel>.md``; variants and sweeps
live in ``schedules/lab/``, which may call a builder's inner, tile-taking function with other
values, but the product never does.

Lookup order for ``tuned(kernel, arch, shape)``: the entry for ``(arch, shape)``, else
``(arch, ANY)``, else ``(ANY, ANY)``. ``arch`` is a CUDA architecture such as ``"sm_90"``
(``ANY`` where the entry holds for every architecture the kernel builds for); ``shape`` is the
kernel's own key (a tuple of the dimensions its tiles depend on) or ``ANY``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ANY = "*"


@dataclass(frozen=True)
class TileKey:
    """Where an entry applies: an architecture (or ANY) and a shape key (or ANY)."""

    arch: str = ANY
    shape: Any = ANY


# ---------------------------------------------------------------------------------------------
# Tile and option types (one per kernel family; fields documented where they are defined).
# ---------------------------------------------------------------------------------------------

# -- MLA attention, prologue, append, prefill attention ---------------------------------------


@dataclass(frozen=True)
class MLAAttentionTiles:
    """:func:`~.mla_attention_cuda.mla_attention_cuda` (schedules/results/mla_attention.md).

    ``stages``: shared page buffers of the pipelined split block's ``cp.async`` ring (>= 2; it
    keeps ``stages - 1`` pages in flight). ``min_pages_per_split``: pages a split takes at least,
    ``long_min_pages`` past ``long_pages`` visible pages (a split's fixed cost against the
    merge's, which grows with the splits). ``max_split``: splits of a row at most.
    ``target_blocks``: split blocks the grid aims at (``smax = clamp(ceil(target_blocks /
    rows), 1, max_split)``). ``merge_cols``: output columns of one merge block."""

    stages: int
    min_pages_per_split: int
    long_min_pages: int
    long_pages: int
    max_split: int
    target_blocks: int
    merge_cols: int


@dataclass(frozen=True)
class MLAPrologueTiles:
    """:func:`~.mla_prologue_cuda.mla_prologue_cuda` (schedules/results/mla_prologue.md).

    ``cols``: latent columns of one column-tile block; ``threads``: threads of a block (column
    groups of one 16-byte load each x reduction groups over ``nope``)."""

    cols: int
    threads: int


@dataclass(frozen=True)
class PrefillAttentionTiles:
    """:func:`~.prefill_attention_cuda.prefill_attention_cuda`
    (schedules/results/prefill_attention.md).

    ``block_m``: query rows of a block (16 per warp); ``block_n``: keys of a KV tile."""

    block_m: int
    block_n: int


# -- MoE decode / grouped GEMMs, decode GEMVs, norm + GEMV ------------------------------------


# ---------------------------------------------------------------------------------------------
# The table.
# ---------------------------------------------------------------------------------------------

TABLE: dict[str, dict[TileKey, Any]] = {
    # -- MLA attention, prologue, append, prefill attention -----------------------------------
    # Measured on sm_90 (H200, V2-Lite shapes); used for every architecture and shape.
    "mla_attention": {
        TileKey(): MLAAttentionTiles(
            stages=3,
            min_pages_per_split=2,
            long_min_pages=4,
            long_pages=128,
            max_split=256,
            target_blocks=528,
            merge_cols=64,
        ),
    },
    "mla_prologue": {TileKey(): MLAPrologueTiles(cols=64, threads=128)},
    "prefill_attention": {TileKey(): PrefillAttentionTiles(block_m=64, block_n=32)},
    # -- MoE decode / grouped GEMMs, decode GEMVs, norm + GEMV --------------------------------
}


def tuned(kernel: str, arch: str | None = None, shape: Any = ANY) -> Any:
    """The tuned parameters of ``kernel`` for ``arch`` and ``shape`` (see the module docstring).

    Raises ``KeyError`` naming the kernel when the table has no entry that applies."""
    entries = TABLE.get(kernel)
    if entries is None:
        raise KeyError(f"no tuned parameters for kernel {kernel!r}")
    arch = arch or ANY
    for key in (TileKey(arch, shape), TileKey(arch, ANY), TileKey(ANY, shape), TileKey(ANY, ANY)):
        if key in entries:
            return entries[key]
    raise KeyError(f"no tuned parameters for kernel {kernel!r} at arch {arch!r}, shape {shape!r}")
