"""Checks of a compiled folder before anything of it is loaded (the trust model: dist/README.md).

A shared library runs code when it is loaded (its constructors), and a library or weight file
shorter than its headers say crashes the process (SIGBUS) instead of failing. So before
:class:`~dsv2_mlc.runtime.engine.Engine` loads a folder, :func:`verify_build` checks it against
what was recorded when it was made: ``BuildConfig.files`` (the compiler writes the size and SHA-256
of the library, every ``params/`` file and ``random-params.json``) and, in an installed artifact,
its ``manifest.json`` (every file, the bundled TVM runtime libraries included).

On every open: every recorded file is present with its recorded size and every one but the weight
shards has its recorded SHA-256 (the library, the bundled runtime libraries, the weight index);
the weight index (``params/tensor-cache.json``) agrees with its shards' sizes. With ``full`` the
weight shards are hashed too. A build made before sizes and hashes were recorded opens with a
one-line warning (logger ``dsv2_mlc``) after a structural check of its library (the ELF headers
fit the file, so a truncated library is an error, not a crash) and of its weight index.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path, PurePosixPath
from typing import Any

from ..layout import LIBRARY, PARAMS_DIR, BuildConfig, BuildError, sha256_file

LOG = logging.getLogger("dsv2_mlc")
ARTIFACT_MANIFEST = "manifest.json"  # an installed artifact's (dsv2_mlc.artifacts.manifest)
WEIGHT_INDEX = f"{PARAMS_DIR}/tensor-cache.json"


class IntegrityError(BuildError):
    """A file of a compiled folder that is missing, damaged or changed: its size or SHA-256 is not
    the recorded one (the message names the file and the fix)."""


def repair_hint(path: Path) -> str:
    """How to get an intact copy of the folder ``path``: pull an artifact again, or compile."""
    if (path / ARTIFACT_MANIFEST).is_file():
        return (
            f"reinstall it: `dsv2-mlc pull {path.name} --force` (or pull the artifact file "
            "it came from with --force)"
        )
    return (
        "compile the model again (a build in the compile-on-first-use cache is compiled again "
        "the next time it is opened)"
    )


def recorded_files(path: Path, build: BuildConfig) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of the folder's files as recorded: ``build.files``, and for an installed
    artifact every file its ``manifest.json`` lists."""
    records = dict(build.files)
    manifest = path / ARTIFACT_MANIFEST
    if manifest.is_file():
        try:
            entries = json.loads(manifest.read_bytes())["files"]
            for e in entries:
                records[str(e["path"])] = {"size": e["size"], "sha256": e["sha256"]}
        except (ValueError, KeyError, TypeError) as err:
            raise IntegrityError(f"{manifest}: unreadable ({err!r}); {repair_hint(path)}") from err
    for rel, rec in records.items():
        parts = PurePosixPath(rel).parts
        bad = not isinstance(rec, dict) or not isinstance(rec.get("size"), int)
        if bad or not rel or rel.startswith("/") or ".." in parts:
            raise IntegrityError(f"{path}: bad file record {rel!r}; {repair_hint(path)}")
    return records


def _is_shard(rel: str) -> bool:
    return rel.startswith(f"{PARAMS_DIR}/") and rel != WEIGHT_INDEX


def verify_build(path: str | Path, build: BuildConfig, *, full: bool = False) -> None:
    """Check the compiled folder ``path`` (its ``dsv2-mlc.json`` read as ``build``) before it is
    loaded, as the module doc says; ``full`` hashes the weight shards too. Raises
    :class:`IntegrityError` naming the file and the fix."""
    path = Path(path)
    hint = repair_hint(path)
    records = recorded_files(path, build)
    for rel, rec in records.items():
        file = path / rel
        if not file.is_file():
            raise IntegrityError(f"{file}: missing; {hint}")
        size = file.stat().st_size
        if size != rec["size"]:
            raise IntegrityError(
                f"{file}: {size} bytes, {rec['size']} when it was made: it is truncated or "
                f"was changed; {hint}"
            )
        if full or not _is_shard(rel):
            digest = sha256_file(file)[1]
            if digest != rec["sha256"]:
                raise IntegrityError(
                    f"{file}: sha256 {digest[:16]}..., {str(rec['sha256'])[:16]}... when it was "
                    f"made: the file was changed; {hint}"
                )
    if LIBRARY not in records:
        LOG.warning(
            "%s: unverified build (made before dsv2-mlc recorded the SHA-256 of its files); "
            "compile it again to have it checked",
            path,
        )
        if (path / LIBRARY).is_file():
            check_elf(path / LIBRARY, hint)
    check_weight_index(path, hint)


def check_weight_index(path: Path, hint: str) -> None:
    """The weight index (``params/tensor-cache.json``), if any, parses and its shards exist with
    the sizes it gives, each tensor inside its shard (a short shard would crash the loader)."""
    index = path / WEIGHT_INDEX
    if not index.is_file():
        return
    try:
        shards = json.loads(index.read_bytes())["records"]
        for shard in shards:
            file = index.parent / str(shard["dataPath"])
            nbytes = int(shard["nbytes"])
            if ".." in PurePosixPath(str(shard["dataPath"])).parts:
                raise ValueError(f"shard path {shard['dataPath']!r} leaves params/")
            if not file.is_file() or file.stat().st_size != nbytes:
                have = file.stat().st_size if file.is_file() else "missing"
                raise IntegrityError(
                    f"{file}: {have} bytes, the weight index says {nbytes}; it is truncated or "
                    f"was changed; {hint}"
                )
            for tensor in shard["records"]:
                if int(tensor["byteOffset"]) + int(tensor["nbytes"]) > nbytes:
                    raise ValueError(f"{tensor['name']} lies past the end of {file.name}")
    except IntegrityError:
        raise
    except (ValueError, KeyError, TypeError) as err:
        raise IntegrityError(f"{index}: damaged weight index ({err}); {hint}") from err


def check_elf(file: Path, hint: str) -> None:
    """``file`` is an ELF shared object whose program and section headers and loadable segments
    all lie within the file (the dynamic loader maps them; past the end they fault)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(64)
        why = _elf_problem(f, head, size)
    if why is not None:
        raise IntegrityError(f"{file}: not a complete shared library ({why}); {hint}")


def _elf_problem(f: Any, head: bytes, size: int) -> str | None:
    if len(head) < 64 or head[:4] != b"\x7fELF":
        return f"{size} bytes, no ELF header"
    if head[4] != 2 or head[5] != 1:  # 64-bit little-endian: x86_64, aarch64
        return None
    phoff, shoff = struct.unpack_from("<QQ", head, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
    if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
        return f"{size} bytes, its headers need more: truncated"
    f.seek(phoff)
    table = f.read(phnum * phentsize)
    for i in range(phnum):
        p_type, _, p_offset = struct.unpack_from("<IIQ", table, i * phentsize)
        p_filesz = struct.unpack_from("<Q", table, i * phentsize + 32)[0]
        if p_type == 1 and p_offset + p_filesz > size:  # PT_LOAD
            return f"{size} bytes, a segment ends at {p_offset + p_filesz}: truncated"
    return None
