"""Lab: compile a model with some of the shipped tile table's parameters replaced.

    python -m dsv2_mlc.schedules.lab.tile_variant_build CONFIG.json OUT \\
        --tiles mla_attention:target_blocks=132 --tiles moe_grouped_mma:warps_n=4 \\
        [--quantization q4f16_g128] [--kv-dtype float16]

Every entry of each named kernel in :data:`dsv2_mlc.schedules.tiles.TABLE` (all its tile keys)
gets the fields given, for this process only, then the config compiles as ``dsv2-mlc compile
CONFIG --random-weights --device cuda`` would (random weights, CUDA). The variant's tiles are
written to ``OUT/tile-variant.json``. Builds made this way are measured on the GPU with the
product's scripts (``scripts/gpu_large_batches.py``, ``dsv2-mlc bench``) against a build of the
shipped table; a variant that wins goes into ``schedules/tiles.py`` with its figures in
``schedules/results/``. The product never imports this module.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dsv2_mlc.schedules import tiles


def parse_override(text: str) -> tuple[str, dict[str, Any]]:
    """``KERNEL:FIELD=VALUE[,FIELD=VALUE...]`` -> (kernel, {field: value}); values are Python
    literals (ints, None, True/False) or else strings."""
    import ast

    kernel, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ValueError(f"--tiles {text!r}: use KERNEL:FIELD=VALUE[,FIELD=VALUE]")
    fields: dict[str, Any] = {}
    for item in rest.split(","):
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--tiles {text!r}: {item!r} is not FIELD=VALUE")
        try:
            fields[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            fields[name.strip()] = value.strip()
    return kernel.strip(), fields


@contextlib.contextmanager
def overridden(overrides: Sequence[tuple[str, dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    """The tile table with ``overrides`` applied to every key of each kernel, restored on exit;
    yields what the overridden entries became (for the record)."""
    saved = {kernel: dict(tiles.TABLE[kernel]) for kernel, _ in overrides if kernel in tiles.TABLE}
    applied: dict[str, Any] = {}
    try:
        for kernel, fields in overrides:
            if kernel not in tiles.TABLE:
                raise KeyError(f"no tile table entry {kernel!r}; see schedules/tiles.py")
            for key, value in list(tiles.TABLE[kernel].items()):
                new = dataclasses.replace(value, **fields)
                tiles.TABLE[kernel][key] = new
                applied[f"{kernel} {key}"] = dataclasses.asdict(new)
        yield applied
    finally:
        for kernel, entries in saved.items():
            tiles.TABLE[kernel] = entries


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("out")
    p.add_argument("--tiles", action="append", default=[], help="KERNEL:FIELD=VALUE[,...]")
    p.add_argument("--quantization", default="q4f16_g128")
    p.add_argument("--kv-dtype", default="float16")
    p.add_argument("--arch", default="sm_90")
    args = p.parse_args(argv)
    from dsv2_mlc.compiler.compile import compile_random_model

    overrides = [parse_override(t) for t in args.tiles]
    with overridden(overrides) as applied:
        compile_random_model(
            Path(args.config), Path(args.out), device="cuda", quantization=args.quantization,
            arch=args.arch, kv_dtype=args.kv_dtype,
        )  # fmt: skip
    (Path(args.out) / "tile-variant.json").write_text(json.dumps(applied, indent=1, default=str))
    print(json.dumps({"out": args.out, "tiles": applied}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
