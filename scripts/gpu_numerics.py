"""GPU numerics of the tiny configs: our CUDA builds against Hugging Face float32 references.

Runs on the GPU machine with only ``tvm_ffi``, the TVM runtime libraries and NumPy (no
``import tvm``, no transformers): the builds and references come from scripts/make_gpu_refs.py.
For every build in ``BUILDS/manifest.json`` it measures

* ``prefill``: logits of every prompt position (one ``batch_prefill``) vs HF: max abs error;
* ``chunked``: the same logits with the prompt prefilled in chunks of 5 (``batch_extend``:
  ragged attention merged with attention over the cached latent pages);
* ``forced``: decode fed HF's greedy tokens (teacher forcing), logits of every step vs HF;
* ``forced_batch``: the same in batches of 4 sequences, sequence ``i`` ``i`` tokens ahead (so
  each step's rows are at different positions, route differently and read pages of their own);
* ``greedy``: 32 free-running greedy tokens vs HF's: tokens equal, first divergence;
* ``decode_ms``: mean wall time of one decode step (batch 1, informational only).

Usage (device machine): ``python3 scripts/gpu_numerics.py --builds REFS --lib-dir TVM_LIB
--out $OUT/gpu_numerics.json`` (REFS: the folder ``scripts/make_gpu_refs.py`` wrote)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np


def _greedy(engine, prompt: list[int], n: int) -> tuple[list[int], float]:
    seq = engine.add_sequence()
    try:
        logits = engine.prefill([seq], [prompt])[0]
        tokens = [int(np.argmax(logits))]
        t0 = time.perf_counter()
        for _ in range(n - 1):
            tokens.append(int(np.argmax(engine.decode([seq], [tokens[-1]])[0])))
        per_step = (time.perf_counter() - t0) / max(n - 1, 1)
    finally:
        engine.remove_sequence(seq)
    return tokens, per_step


def _forced(engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    seq = engine.add_sequence()
    try:
        steps = [engine.prefill([seq], [prompt])[0]]
        for tok in tokens[:-1]:
            steps.append(engine.decode([seq], [tok])[0])
    finally:
        engine.remove_sequence(seq)
    return np.stack(steps)


def _forced_batch(
    engine, prompt: list[int], tokens: list[int], ref: np.ndarray, rows: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher forcing in a batch of ``rows`` sequences, sequence ``i`` prefilled with ``i`` of
    ``tokens`` more; returns our logits of every step and row and HF's (``ref``: the forced
    logits of every position) for the same positions, ``[steps, rows, vocab]`` each."""
    seqs = [engine.add_sequence() for _ in range(rows)]
    try:
        engine.prefill(seqs, [prompt + tokens[:i] for i in range(rows)])
        ours, expect = [], []
        for t in range(len(tokens) - rows):
            ours.append(engine.decode(seqs, [tokens[i + t] for i in range(rows)]))
            expect.append(ref[[len(prompt) + i + t for i in range(rows)]])
    finally:
        for seq in seqs:
            engine.remove_sequence(seq)
    return np.stack(ours), np.stack(expect)


def _err(ours: np.ndarray, ref: np.ndarray) -> dict:
    if ours.shape != ref.shape:
        raise AssertionError(f"shape {ours.shape} != reference {ref.shape}")
    diff = np.abs(ours.astype(np.float64) - ref)
    differ = ours.argmax(-1) != ref.argmax(-1)
    top2 = np.sort(ref, axis=-1)[..., -2:]
    margin = top2[..., 1] - top2[..., 0]  # the reference's own top-2 gap, per row
    return {
        "max_abs": float(diff.max()),
        "max_abs_ref": float(np.abs(ref).max()),
        "rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(ref)),
        "finite": bool(np.isfinite(ours).all()),
        "argmax_agree": float(1.0 - differ.mean()),
        # where the arg-maxes part, the largest reference top-2 gap (0: they never part)
        "argmax_differs_ref_margin": float(margin[differ].max()) if differ.any() else 0.0,
    }


def check_build(
    path: Path,
    refs: Path,
    prompt: list[int],
    n: int,
    lib_dir: str | None,
    random_weights: int | None = None,
) -> dict:
    """All measurements for one compiled model folder (``random_weights``: the seed of a build
    compiled with ``--random-weights``; ``refs`` then come from HF on those weights)."""
    from dsv2_mlc.runtime.engine import Engine

    t0 = time.perf_counter()
    kw = dict(context_window=256, max_batch_size=4, lib_dir=lib_dir, random_weights=random_weights)
    engine = Engine(path, **kw)
    result: dict = {"load_seconds": round(time.perf_counter() - t0, 2)}
    ref_prefill = np.load(refs / "prefill_logits.npy")
    ref_tokens = [int(t) for t in np.load(refs / "greedy_tokens.npy")][:n]
    ref_forced = np.load(refs / "forced_logits.npy")

    result["prefill"] = _err(engine.logits(prompt), ref_prefill)
    chunked = Engine(path, prefill_chunk_size=5, **kw)
    result["chunked"] = _err(chunked.logits(prompt), ref_prefill)
    forced = _forced(engine, prompt, ref_tokens)
    expect = ref_forced[len(prompt) - 1 : len(prompt) - 1 + n]
    result["forced"] = _err(forced, expect)
    result["forced"]["per_step_max_abs"] = np.abs(forced - expect).max(-1).round(5).tolist()
    ours, expect = _forced_batch(engine, prompt, ref_tokens, ref_forced)
    result["forced_batch"] = _err(ours, expect)
    _greedy(engine, prompt, 4)  # warm-up
    tokens, per_step = _greedy(engine, prompt, n)
    same = [a == b for a, b in zip(tokens, ref_tokens, strict=True)]
    result["greedy"] = {
        "tokens": tokens,
        "reference": ref_tokens,
        "equal": sum(same),
        "of": n,
        "first_divergence": same.index(False) if not all(same) else None,
    }
    result["decode_ms"] = round(per_step * 1e3, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    """Check every build of the manifest; print a table; write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", required=True, help="the folder make_gpu_refs.py wrote")
    parser.add_argument("--lib-dir", default=None, help="folder of libtvm_runtime*.so")
    parser.add_argument("--out", default=None, help="JSON report path")
    args = parser.parse_args(argv)

    import tvm_ffi

    builds = Path(args.builds).resolve()
    manifest = json.loads((builds / "manifest.json").read_text())
    prompt, n = manifest["prompt"], manifest["new_tokens"]
    report: dict = {"manifest": manifest, "results": {}}
    for tag, info in manifest["builds"].items():
        try:
            refs = builds / info.get("refs", f"refs/{info['config']}")
            res = check_build(builds / tag, refs, prompt, n, args.lib_dir)
        except Exception as err:  # report every build, even after a failure
            res = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
        report["results"][tag] = res
    report["tvm_callback_cuda_compile_registered"] = (
        tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True) is not None
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))

    print(f"tvm_callback_cuda_compile registered: {report['tvm_callback_cuda_compile_registered']}")
    cols = ("prefill", "chunked", "forced", "forced_batch")
    print(
        f"{'build':14s} "
        + " ".join(f"{c:>9s}" for c in cols)
        + f" {'greedy':>7s} {'div':>4s} {'|ref|max':>8s} {'ms/tok':>7s}"
    )
    ok = True
    for tag, res in report["results"].items():
        if "error" in res:
            ok = False
            print(f"{tag:14s} ERROR {res['error'][:300]}")
            continue
        g = res["greedy"]
        div = "-" if g["first_divergence"] is None else str(g["first_divergence"])
        print(
            f"{tag:14s} {res['prefill']['max_abs']:9.2e} {res['chunked']['max_abs']:9.2e} "
            f"{res['forced']['max_abs']:9.2e} {res['forced_batch']['max_abs']:9.2e} "
            f"{g['equal']:>3d}/{g['of']:<3d} {div:>4s} "
            f"{res['prefill']['max_abs_ref']:8.2f} {res['decode_ms']:7.2f}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
