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


# -- MoE decode / grouped GEMMs, decode GEMVs, norm + GEMV ------------------------------------


# ---------------------------------------------------------------------------------------------
# The table.
# ---------------------------------------------------------------------------------------------

TABLE: dict[str, dict[TileKey, Any]] = {
    # -- MLA attention, prologue, append, prefill attention -----------------------------------
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
