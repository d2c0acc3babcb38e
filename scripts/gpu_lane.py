"""The GPU lane's builds (tests/gpu): compiled here, on a machine with TVM and nvcc, no GPU.

``python scripts/gpu_lane.py prepare --out DIR`` compiles, for CUDA ``sm_90`` and with
``--random-weights`` (the runtime creates the weights on the GPU, so a build is its library and a
few JSON files):

* ``v2-lite-q4f16_g128``: DeepSeek-V2-Lite's shape (:data:`V2_LITE_CONFIG`, or
  ``--v2-lite-config``), INT4 group 128; PDL on and cuBLAS prefill GEMMs (the CUDA defaults). It
  serves the V2-Lite numerics against HF fp16, the CUDA-graph, graph-move, PDL, arg-max, cuBLAS
  and overlapped-generation tests;
* :data:`TINY_BUILDS`: the test suite's tiny configs A and B (tests/hf_reference.py), for the
  logits and greedy tokens against HF float32.

No reference is computed here: the tests build HF models on the GPU machine from the same random
weights (:func:`dsv2_mlc.hf_export.load_into_hf`). ``DIR/wheels`` gets pytest and its
dependencies (pure-Python wheels) for the GPU machine's Python, and ``DIR/manifest.json`` says
what was built (read by :func:`read_manifest`). The device command is in tests/gpu/README.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"
FORMAT, FORMAT_VERSION = "dsv2-mlc-gpu-lane", 1
ARCH = "sm_90"
V2_LITE = "v2-lite-q4f16_g128"
# (tag, tiny config of tests/hf_reference.py, quantization): fp16 and INT4 of both configs, and
# one float32 build (its tolerance is four orders of magnitude tighter)
TINY_BUILDS = (
    ("A-q0f16", "A", "q0f16"),
    ("A-q4f16_g32", "A", "q4f16_g32"),
    ("B-q0f16", "B", "q0f16"),
    ("B-q4f16_g32", "B", "q4f16_g32"),
    ("A-q0f32", "A", "q0f32"),
)
# deepseek-ai/DeepSeek-V2-Lite's config.json (the fields the compiler reads)
V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}
WHEELS = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")  # pytest and its requirements


class ManifestError(RuntimeError):
    """A builds folder without a readable lane manifest, or without the build asked for."""


@dataclass(frozen=True)
class LaneBuild:
    """One build of the manifest: its folder and what it is."""

    tag: str
    path: Path
    kind: str  # "v2-lite" or "tiny"
    config: str  # "v2-lite", "A" or "B"
    quantization: str
    dtype: str
    pdl: bool
    gemm: str  # who runs the prefill GEMMs: "cublas" or "tir"


@dataclass(frozen=True)
class Manifest:
    """A prepared builds folder (``manifest.json``)."""

    root: Path
    data: dict

    @property
    def commit(self) -> str:
        return str(self.data.get("commit", "unknown"))

    def build(self, tag: str) -> LaneBuild:
        """The build ``tag``; :class:`ManifestError` if it was not prepared or is missing."""
        info = self.data["builds"].get(tag)
        if info is None:
            raise ManifestError(f"{self.root}: no build {tag!r} (prepared: "
                                f"{', '.join(self.data['builds']) or 'none'})")  # fmt: skip
        path = self.root / tag
        if not (path / "dsv2-mlc.json").is_file():
            raise ManifestError(f"{path}: listed in the manifest, but not there")
        return LaneBuild(tag, path, info["kind"], info["config"], info["quantization"],
                         info["dtype"], bool(info["pdl"]), info["gemm"])  # fmt: skip


def read_manifest(root: str | Path) -> Manifest:
    """The lane manifest of the builds folder ``root`` (written by ``prepare``)."""
    path = Path(root) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        msg = f"{path}: cannot read ({err}); run scripts/gpu_lane.py prepare"
        raise ManifestError(msg) from err
    if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} manifest")
    return Manifest(Path(root), data)


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                         check=False)  # fmt: skip
    return out.stdout


def _compile(config: dict, out: Path, tag: str, quantization: str, arch: str) -> dict:
    from dsv2_mlc.compiler.compile import compile_random_model
    from dsv2_mlc.layout import BuildConfig

    cfg = out / "configs" / f"{tag}.json"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(json.dumps(config, indent=1))
    t0 = time.perf_counter()
    compile_random_model(cfg, out / tag, device="cuda", quantization=quantization, arch=arch)
    seconds = time.perf_counter() - t0
    build = BuildConfig.read(out / tag)
    size = sum(f.stat().st_size for f in (out / tag).rglob("*") if f.is_file())
    print(f"compiled {tag} in {seconds:.0f} s ({size / 2**20:.1f} MiB)", flush=True)
    return {"quantization": quantization, "dtype": build.dtype, "pdl": bool(build.pdl),
            "gemm": build.gemm, "compile_seconds": round(seconds, 1), "bytes": size}  # fmt: skip


def _wheels(dest: Path) -> None:
    """pytest's wheels for the GPU machine (pure Python: any interpreter of 3.10+)."""
    import importlib.metadata as md

    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={md.version(name)}" for name in WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "-d", str(dest), *pins], check=True)  # fmt: skip


def prepare(out: Path, *, arch: str = ARCH, only: list[str] | None = None,
            v2_lite_config: dict | None = None, wheels: bool = True) -> dict:  # fmt: skip
    """Compile the lane's builds into ``out`` and write its manifest; returns the manifest."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_reference import CONFIG_A, CONFIG_B

    import dsv2_mlc

    tiny = {"A": CONFIG_A, "B": CONFIG_B}
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    builds: dict[str, dict] = {}
    if only is None or V2_LITE in only:
        info = _compile(v2_lite_config or V2_LITE_CONFIG, out, V2_LITE, "q4f16_g128", arch)
        builds[V2_LITE] = {"kind": "v2-lite", "config": "v2-lite", **info}
    for tag, name, quant in TINY_BUILDS:
        if only is None or tag in only:
            builds[tag] = {"kind": "tiny", "config": name, **_compile(tiny[name], out, tag,
                                                                       quant, arch)}  # fmt: skip
    if wheels:
        _wheels(out / "wheels")
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "commit": _git("rev-parse", "--short", "HEAD").strip() or "unknown",
        "modified_files": [x[3:] for x in _git("status", "--porcelain", "-uno").splitlines()],
        "arch": arch,
        "versions": {
            "dsv2_mlc": getattr(dsv2_mlc, "__version__", "unknown"),
            "python": sys.version.split()[0],
        },  # fmt: skip
        "builds": builds,
        "prepare_seconds": round(time.perf_counter() - t0, 1),
    }
    manifest["total_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="compile the lane's builds and write the manifest")
    prep.add_argument("--out", required=True, help="builds folder (carried to the GPU machine)")
    prep.add_argument("--arch", default=ARCH)
    prep.add_argument("--only", nargs="+", default=None, help="these build tags only")
    prep.add_argument("--v2-lite-config", default=None, help="config.json of the V2-Lite build")
    prep.add_argument("--no-wheels", action="store_true", help="do not download pytest's wheels")
    args = p.parse_args(argv)
    cfg = json.loads(Path(args.v2_lite_config).read_text()) if args.v2_lite_config else None
    manifest = prepare(Path(args.out), arch=args.arch, only=args.only, v2_lite_config=cfg,
                       wheels=not args.no_wheels)  # fmt: skip
    print(
        f"wrote {Path(args.out) / MANIFEST}: {len(manifest['builds'])} builds, "
        f"{manifest['total_bytes'] / 2**20:.1f} MiB, {manifest['prepare_seconds']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
