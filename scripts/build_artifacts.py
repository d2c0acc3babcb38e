"""BUILD SCRIPT for the published artifacts: writes dist/artifacts/*.tar and dist/index.json.

For each planned build (the embedded default model for the CPU and for CUDA sm_90) it compiles the
checkpoint (``dsv2-mlc compile``), packages the result (``dsv2-mlc package``) into ``--out`` and
records the artifact in the index: name, target, versions, URL (relative to the index, or under
``--base-url``), size, SHA-256 of the file and of its manifest. Entries of other artifacts in the
index are kept. See dist/README.md ("Building and publishing").

    python scripts/build_artifacts.py                       # every planned build
    python scripts/build_artifacts.py --only cpu            # the CPU one (no nvcc needed)
    python scripts/build_artifacts.py --placeholder         # index entries only, nothing built

The CUDA build needs nvcc and gcc (no GPU). ``--placeholder`` writes the planned entries without
url/hashes, for a model that does not exist yet; ``dsv2-mlc pull NAME`` then says it is unpublished.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dsv2_mlc.artifacts.index import entry_for, write_index  # noqa: E402
from dsv2_mlc.artifacts.target import host_machine  # noqa: E402


@dataclass(frozen=True)
class Build:
    """One published artifact: device, quantization and (CUDA) architecture."""

    device: str
    quantization: str
    arch: str | None = None

    def name(self, model_name: str) -> str:
        suffix = self.device + (f"-{self.arch}" if self.arch else "")
        return f"{model_name}-{self.quantization}-{suffix}"


PLAN = (Build("cpu", "q4f32_g32"), Build("cuda", "q4f16_g32", "sm_90"))


def _versions() -> dict[str, str]:
    import importlib.metadata

    return {
        "tvm_version": importlib.metadata.version("apache-tvm"),
        "tvm_ffi_version": importlib.metadata.version("apache-tvm-ffi"),
    }


def placeholder(build: Build, model_name: str) -> dict[str, Any]:
    """The index entry of a planned, not yet built, artifact."""
    return {
        "name": build.name(model_name),
        "model": model_name,
        "quantization": build.quantization,
        "dtype": "float16" if "f16" in build.quantization else "float32",
        "target": {
            "device": build.device,
            "os": "linux",
            "machine": host_machine(),
            "cuda_arch": build.arch,
            "cuda_runtime": 13 if build.device == "cuda" else None,
        },
        **_versions(),
        "url": None,
        "size": None,
        "sha256": None,
        "manifest_sha256": None,
        "status": "not built yet: run scripts/build_artifacts.py once the default model is trained",
    }


def build_one(
    build: Build, model: Path, model_name: str, out: Path, work: Path, url_base: str
) -> dict[str, Any]:
    """Compile, package and describe one artifact."""
    from dsv2_mlc.artifacts.package import package_artifact
    from dsv2_mlc.compiler.compile import compile_model

    name = build.name(model_name)
    compiled = work / name
    kwargs = {"arch": build.arch} if build.arch else {}
    compile_model(model, compiled, device=build.device, quantization=build.quantization, **kwargs)
    result = package_artifact(compiled, out / f"{name}.tar", name=name, model_name=model_name)
    print(f"{name}: {result.path} ({result.size} bytes, manifest {result.manifest_sha256})")
    return entry_for(result, f"{url_base}/{result.path.name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=REPO / "dsv2_mlc" / "default_model")
    p.add_argument("--model-name", default="dsv2-coder-tiny")
    p.add_argument("--out", type=Path, default=REPO / "dist" / "artifacts")
    p.add_argument("--index", type=Path, default=REPO / "dist" / "index.json")
    p.add_argument("--work", type=Path, default=REPO / "build" / "artifacts")
    p.add_argument("--base-url", default=None, help="where the .tar files will be published")
    p.add_argument("--only", choices=("cpu", "cuda"), default=None)
    p.add_argument("--placeholder", action="store_true", help="write planned entries only")
    args = p.parse_args(argv)

    plan = [b for b in PLAN if args.only in (None, b.device)]
    if not args.placeholder and not (args.model / "config.json").is_file():
        print(
            f"{args.model}: no config.json; train the default model first "
            "(scripts/train_default_model.py) or pass --placeholder",
            file=sys.stderr,
        )
        return 2
    # Entry URLs: under --base-url, else relative to the index (published side by side).
    out = args.out.resolve()
    url_base = (args.base_url or os.path.relpath(out, args.index.resolve().parent)).rstrip("/")
    entries = {}
    if args.index.is_file():
        entries = {e["name"]: e for e in json.loads(args.index.read_text())["artifacts"]}
    for build in plan:
        if args.placeholder:
            entry = placeholder(build, args.model_name)
        else:
            entry = build_one(build, args.model, args.model_name, args.out, args.work, url_base)
        entries[entry["name"]] = entry
    write_index(
        args.index,
        list(entries.values()),
        description="dsv2-mlc's published artifacts; see dist/README.md",
    )
    print(f"wrote {args.index} ({len(entries)} artifacts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
