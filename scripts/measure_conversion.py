"""Time the weight conversion of a checkpoint layer by layer, and extrapolate to more layers.

Runs what ``dsv2-mlc compile`` does to the weights (``converted_params``: read, convert,
quantize) without compiling the library, writing them with ``tvmjs.dump_tensor_cache`` into
``--out`` (or discarding them with ``--discard``), and prints JSON: wall and CPU seconds and
checkpoint bytes per part (embedding, each layer, final norm and ``lm_head``), the peak resident
and anonymous memory of the process, and, with ``--layers N``, the time of an N-layer model of
the same widths extrapolated from the measured parts (the first dense layers as measured, every
further layer at the mean of the measured MoE layers; marked as an extrapolation)::

    python scripts/measure_conversion.py V2_3L --quantization q4f16_g128 --layers 60 --discard
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def _part(name: str) -> str:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return f"layer {m.group(1)}" if m else ("embedding" if "embed" in name else "head")


def _anon_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    from dsv2_mlc.compiler.compile import _export, converted_params, make_target
    from dsv2_mlc.model.checkpoint import SafetensorsCheckpoint
    from dsv2_mlc.model.config import DeepseekV2Config
    from dsv2_mlc.model.weights import check_checkpoint, weight_map
    from dsv2_mlc.quant import get_quantization

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--quantization", default="q4f16_g128")
    ap.add_argument("--layers", type=int, default=None, help="extrapolate to this many layers")
    ap.add_argument("--out", type=Path, default=None, help="tensor-cache folder (default: temp)")
    ap.add_argument("--discard", action="store_true", help="do not write the converted weights")
    args = ap.parse_args()

    cfg = DeepseekV2Config.from_file(args.model_dir)
    _, named, plan = _export(cfg, make_target("cuda"), get_quantization(args.quantization))
    dtypes = {name: str(p.dtype) for name, p in named}
    convs = weight_map(cfg)
    ckpt = SafetensorsCheckpoint(args.model_dir)
    check_checkpoint(convs, ckpt)
    src_bytes: dict[str, int] = {}
    for conv in convs:
        for name, _ in conv.sources:
            info = ckpt.tensors[name]
            src_bytes[_part(name)] = src_bytes.get(_part(name), 0) + info.end - info.begin
    parts: dict[str, dict[str, float]] = {}
    peak_anon = [0]

    def timed() -> Iterator[tuple[str, np.ndarray]]:
        # each item's time: producing it (read, convert, quantize) and its consumer writing it
        wall, cpu = time.perf_counter(), time.process_time()
        for name, arr in converted_params(convs, ckpt, dtypes, plan):
            peak_anon[0] = max(peak_anon[0], _anon_kb())
            yield name, arr
            del arr
            now_wall, now_cpu = time.perf_counter(), time.process_time()
            rec = parts.setdefault(_part(name), {"wall_s": 0.0, "cpu_s": 0.0})
            rec["wall_s"] += now_wall - wall
            rec["cpu_s"] += now_cpu - cpu
            wall, cpu = now_wall, now_cpu

    start = time.perf_counter()
    if args.discard:
        for _ in timed():
            pass
    else:
        from tvm.contrib import tvmjs

        out = args.out or Path(tempfile.mkdtemp(prefix="dsv2_conv_"))
        tvmjs.dump_tensor_cache(timed(), str(out), encode_format="raw", show_progress=False)
    total = time.perf_counter() - start
    ckpt.close()

    moe = [f"layer {i}" for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    report = {
        "model_dir": str(args.model_dir),
        "quantization": args.quantization,
        "written": not args.discard,
        "checkpoint_gb": round(sum(src_bytes.values()) / 1e9, 3),
        "parts": {
            k: {**{m: round(v, 2) for m, v in rec.items()}, "gb": round(src_bytes[k] / 1e9, 3)}
            for k, rec in parts.items()
        },
        "conversion_wall_s": round(total, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
        "peak_anon_gb_sampled": round(peak_anon[0] / 1e6, 2),
    }
    if args.layers and moe:
        measured = {k: v for k, v in parts.items() if not k.startswith("layer")}
        dense = [f"layer {i}" for i in range(args.layers) if i < cfg.first_k_dense_replace]
        per_moe = {m: sum(parts[k][m] for k in moe) / len(moe) for m in ("wall_s", "cpu_s")}
        gb_moe = sum(src_bytes[k] for k in moe) / len(moe)
        n_moe = args.layers - len(dense)
        est = {
            m: sum(v[m] for v in measured.values())
            + sum(parts[k][m] for k in dense)
            + n_moe * per_moe[m]
            for m in ("wall_s", "cpu_s")
        }
        gb = sum(src_bytes[k] for k in measured) + sum(src_bytes[k] for k in dense)
        report["extrapolated"] = {
            "note": "EXTRAPOLATION from the measured parts, not a measurement",
            "layers": args.layers,
            "moe_layer_wall_s": round(per_moe["wall_s"], 1),
            "moe_layer_cpu_s": round(per_moe["cpu_s"], 1),
            "checkpoint_gb": round((gb + n_moe * gb_moe) / 1e9, 1),
            "conversion_wall_min": round(est["wall_s"] / 60, 1),
            "conversion_cpu_min": round(est["cpu_s"] / 60, 1),
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
