"""Nothing of the user's is deleted, and bad input is a one-line error, never a traceback.

``compile`` replaces an output folder only when it holds exactly an earlier build, and never when
an input or the IR dump lies inside it: each refusal comes before any work and leaves every file
as it was. ``package`` replaces only an artifact file; the compile-on-first-use cache says which
folder it cannot write; ``chat`` keeps the conversation when a line on stdin is not UTF-8.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hf_reference import CONFIG_A

import dsv2_mlc
from dsv2_mlc.chat_repl import replace_undecodable
from dsv2_mlc.cli import main
from dsv2_mlc.compiler import compile as compiler
from dsv2_mlc.compiler.compile import CompileError, compile_model
from dsv2_mlc.fsutil import UnwritableFolderError, staged_dir
from dsv2_mlc.layout import BUILD_CONFIG
from dsv2_mlc.resolve import CACHE_DIR_ENV


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: file contents, ``None`` for folders."""
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    """``dsv2-mlc ARGV`` in this process: exit status and stderr (a raised error fails the test)."""
    rc = main(list(argv))
    return rc, capsys.readouterr().err.strip()


@pytest.fixture()
def no_work(monkeypatch):
    """Compiling fails the test: a refusal must come before the config is read or traced."""

    def boom(*_args, **_kwargs):
        raise AssertionError("compile started work before refusing")

    monkeypatch.setattr(compiler, "_export", boom)
    monkeypatch.setattr(compiler.DeepseekV2Config, "from_file", boom)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.json"
    path.write_text(json.dumps(CONFIG_A))
    return path


@pytest.fixture(scope="module")
def random_build(tiny_config, tmp_path_factory) -> Path:
    """A config-only build of the tiny config (what `compile CONFIG --random-weights` writes)."""
    out = tmp_path_factory.mktemp("random") / "build"
    compiler.compile_random_model(tiny_config, out)
    return out


@pytest.fixture()
def earlier(random_build, tmp_path) -> Path:
    """An output folder holding an earlier (config-only) build."""
    out = tmp_path / "out"
    shutil.copytree(random_build, out)
    return out


# -- compile: the output folder -------------------------------------------------------------------
def test_an_earlier_build_is_replaced(earlier, tiny_config, capsys):
    before = (earlier / BUILD_CONFIG).stat().st_ino
    rc, err = _cli(capsys, "compile", str(tiny_config), "--random-weights", "-o", str(earlier))
    assert (rc, err) == (0, "")
    assert (earlier / BUILD_CONFIG).stat().st_ino != before  # a new build, moved into place
    assert sorted(p.name for p in earlier.iterdir()) == [
        BUILD_CONFIG,
        "model.so",
        "random-params.json",
    ]
    umask = os.umask(0)
    os.umask(umask)
    assert earlier.stat().st_mode & 0o777 == 0o777 & ~umask  # not the staging folder's 0700
    assert _leftovers(earlier.parent) == []


def test_a_checkpoint_build_with_its_params_is_replaced(compiled, checkpoints, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(compiled["A"], out)
    assert (out / "params" / "tensor-cache.json").is_file()
    compile_model(checkpoints["A"], out, progress=False)
    assert sorted(p.name for p in (out / "params").iterdir()) == sorted(
        p.name for p in (compiled["A"] / "params").iterdir()
    )


def test_user_files_in_an_earlier_build_are_refused(earlier, tiny_config, capsys, no_work):
    (earlier / "notes.txt").write_text("keep me")
    (earlier / "mydata").mkdir()
    (earlier / "mydata" / "table.csv").write_text("1,2\n")
    before = _snapshot(earlier)
    rc, err = _cli(capsys, "compile", str(tiny_config), "--random-weights", "-o", str(earlier))
    assert rc == 2
    assert err == (
        f"dsv2-mlc compile: error: {earlier}: holds an earlier build and mydata/, notes.txt, "
        "which a build does not write; compiling replaces the folder and would delete them: "
        "choose another output folder, or move them out first"
    )
    assert _snapshot(earlier) == before
    assert _leftovers(earlier.parent) == []


def test_params_files_its_index_does_not_list_are_refused(compiled, checkpoints, tmp_path, no_work):
    out = tmp_path / "out"
    shutil.copytree(compiled["A"], out)
    (out / "params" / "extra.bin").write_bytes(b"\0" * 8)
    (out / "params" / "old").mkdir()
    (out / "random-params.json").mkdir()  # a name a build writes, but a folder, not its file
    before = _snapshot(out)
    with pytest.raises(CompileError) as info:
        compile_model(checkpoints["A"], out, progress=False)
    assert "holds an earlier build and params/extra.bin, params/old/, random-params.json/," in str(
        info.value
    )
    assert _snapshot(out) == before


def test_an_unreadable_params_index_makes_params_foreign(earlier):
    (earlier / "params").mkdir()
    (earlier / "params" / "tensor-cache.json").write_text("{not json")
    assert compiler.foreign_entries(earlier) == ["params/tensor-cache.json"]


def test_a_checkpoint_inside_the_output_folder_is_refused(
    earlier, checkpoints, tmp_path, capsys, no_work
):
    ckpt = earlier / "ckpt"
    shutil.copytree(checkpoints["A"], ckpt)
    before = _snapshot(earlier)
    rc, err = _cli(capsys, "compile", str(ckpt), "-o", str(earlier))
    assert rc == 2
    assert err == (
        f"dsv2-mlc compile: error: {ckpt} is inside the output folder {earlier}, which the build "
        "replaces (so it would be deleted); choose an output folder outside it"
    )
    assert _snapshot(earlier) == before

    # the output folder is the checkpoint folder itself
    rc, err = _cli(capsys, "compile", str(ckpt), "-o", str(ckpt))
    assert rc == 2 and f"{ckpt} is inside the output folder {ckpt}," in err
    assert _snapshot(earlier) == before


def test_a_config_file_inside_the_output_folder_is_refused(earlier, capsys, no_work):
    config = earlier / "my-config.json"
    config.write_text(json.dumps(CONFIG_A))
    before = _snapshot(earlier)
    rc, err = _cli(capsys, "compile", str(config), "--random-weights", "-o", str(earlier))
    assert rc == 2 and err.startswith(f"dsv2-mlc compile: error: {config} is inside the output")
    assert _snapshot(earlier) == before


@pytest.mark.parametrize("exists", [True, False], ids=["earlier-build", "new-folder"])
def test_a_dump_inside_the_output_folder_is_refused(
    exists, earlier, tiny_config, tmp_path, capsys, no_work
):
    out = earlier if exists else tmp_path / "new"
    before = _snapshot(earlier)
    argv = ["compile", str(tiny_config), "--random-weights", "--dump-ir", str(out / "ir")]
    rc, err = _cli(capsys, *argv, "-o", str(out))
    assert rc == 2
    assert err == (
        f"dsv2-mlc compile: error: --dump-ir {out / 'ir'} is inside the output folder {out}, "
        "which the build replaces (so the dump would be deleted); write the dump to a folder "
        "outside it"
    )
    assert _snapshot(earlier) == before
    assert exists or not out.exists()


def test_files_added_while_compiling_are_kept(earlier):
    """The check runs again just before the earlier build is replaced."""
    before = _snapshot(earlier)
    with (
        pytest.raises(CompileError, match="notes.txt"),
        staged_dir(earlier, compiler._check_out_dir) as tmp,
    ):
        (tmp / BUILD_CONFIG).write_text("{}")
        (earlier / "notes.txt").write_text("written meanwhile")
    assert _snapshot(earlier) == {**before, "notes.txt": b"written meanwhile"}
    assert _leftovers(earlier.parent) == []


def test_an_unwritable_output_parent_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with (
        pytest.raises(UnwritableFolderError, match="cannot write there"),
        staged_dir(tmp_path / "file" / "out"),
    ):
        pass
    assert (tmp_path / "file").read_text() == ""


# -- compile: bad configs are one-line errors -----------------------------------------------------
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_position_embeddings": -1}, "max_position_embeddings=-1 must be in [1, "),
        ({"hidden_size": -8}, "hidden_size=-8 must be in [1, "),
        ({"num_hidden_layers": -1}, "num_hidden_layers=-1 must be in [1, "),
        ({"vocab_size": 0}, "vocab_size=0 must be in [1, "),
    ],
)
def test_negative_sizes_with_random_weights(change, message, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**CONFIG_A, **change}))
    out = tmp_path / "out"
    rc, err = _cli(capsys, "compile", str(config), "--random-weights", "-o", str(out))
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("dsv2-mlc compile: error: ") and message in err
    assert not out.exists()


@pytest.mark.parametrize("random_weights", [True, False], ids=["random-weights", "checkpoint"])
def test_a_config_that_is_a_list_is_one_line(random_weights, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("[]")
    argv = ["compile", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out")]
    proc = subprocess.run(
        [sys.executable, "-m", "dsv2_mlc.cli", *argv, *(["--random-weights"] * random_weights)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "dsv2-mlc compile: error: config.json: expected a JSON object of settings, found list"
    ]
    assert not (tmp_path / "out").exists()


# -- package --------------------------------------------------------------------------------------
def test_package_replaces_only_an_artifact(compiled, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    rc, err = _cli(capsys, "package", str(compiled["A"]), "-o", str(notes))
    assert rc == 2
    assert err == (
        f"dsv2-mlc package: error: {notes}: exists and is not a dsv2-mlc artifact, and packaging "
        "would replace it; choose another path, or move that file away first"
    )
    assert notes.read_text() == "keep me"

    # a folder: NAME.tar in it, refused when NAME.tar is not an artifact
    (tmp_path / "dist").mkdir()
    clash = tmp_path / "dist" / "tiny-q0f32-cpu.tar"
    clash.write_text("mine")
    argv = ["package", str(compiled["A"]), "--model-name", "tiny", "-o", str(tmp_path / "dist")]
    rc, err = _cli(capsys, *argv)
    assert rc == 2 and f"{clash}: exists and is not a dsv2-mlc artifact" in err
    assert clash.read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == [clash.name]

    # an earlier artifact is replaced (the same bytes: packaging is deterministic)
    clash.unlink()
    assert _cli(capsys, *argv)[0] == 0
    first = clash.read_bytes()
    assert _cli(capsys, *argv)[0] == 0
    assert clash.read_bytes() == first


# -- the compile-on-first-use cache ---------------------------------------------------------------
def _unwritable(folder: Path) -> bool:
    """Make ``folder`` unwritable (chmod, or for root ``chattr +i``); whether that worked."""
    folder.chmod(0o555)
    probe = folder / ".probe"
    try:
        probe.touch()
    except OSError:
        return True
    probe.unlink()
    if shutil.which("chattr"):
        subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
        try:
            probe.touch()
        except OSError:
            return True
        probe.unlink()
    return False


@pytest.mark.parametrize("how", ["read-only", "under-a-file"])
def test_an_unwritable_cache_is_a_clear_error(how, checkpoints, tmp_path, capsys):
    if how == "read-only":
        cache = tmp_path / "cache"
        (cache / "builds").mkdir(parents=True)
        blocked = cache / "builds"
        if not _unwritable(blocked):
            pytest.skip("cannot make a folder unwritable here")
    else:
        (tmp_path / "file").write_text("")
        cache = tmp_path / "file" / "cache"
        blocked = cache / "builds"
    try:
        ckpt = checkpoints["A"]
        with pytest.raises(UnwritableFolderError) as info:
            dsv2_mlc.load(ckpt, cache_dir=cache)
        assert str(info.value).startswith(
            f"{blocked}: the cache of checkpoints compiled on first use cannot be written ("
        )
        assert f"set {CACHE_DIR_ENV} or --cache-dir" in str(info.value)
        assert f"`dsv2-mlc compile {ckpt} -o OUT`" in str(info.value)
        rc, err = _cli(capsys, "chat", str(ckpt), "--cache-dir", str(cache), "--prompt", "x")
        assert rc == 2 and err.splitlines() == [f"dsv2-mlc chat: error: {info.value}"]
    finally:
        if how == "read-only":
            subprocess.run(["chattr", "-i", str(blocked)], capture_output=True)
            blocked.chmod(0o755)
    assert how != "read-only" or list(blocked.iterdir()) == []


# -- chat: bytes that are not UTF-8 on stdin ------------------------------------------------------
def test_replace_undecodable():
    raw = b"ab\xff\xfec \xe2\x82\xac"
    text = raw.decode("utf-8", "surrogateescape")
    assert replace_undecodable(text) == (raw.decode("utf-8", "replace"), 2)
    assert replace_undecodable("plain \u20ac") == ("plain \u20ac", 0)


def test_chat_keeps_the_conversation_after_bytes_that_are_not_utf8(default_model_cache):
    """Piped into `dsv2-mlc chat` (default model): the line gets U+FFFD for each bad byte, the
    REPL goes on, and the replies are those of the same conversation typed with U+FFFD."""
    cache, first = default_model_cache
    assert first.returncode == 0, first.stderr

    def chat(data: bytes, encoding: str) -> subprocess.CompletedProcess:
        env = {**os.environ, CACHE_DIR_ENV: str(cache), "PYTHONIOENCODING": encoding}
        argv = ["chat", "--max-tokens", "4", "--temperature", "0"]
        return subprocess.run(
            [sys.executable, "-m", "dsv2_mlc.cli", *argv],
            input=data,
            capture_output=True,
            timeout=300,
            env=env,
        )

    script = b"hello\n%s bad\nworld\n/stats\n"
    bad = chat(script % b"\xff\xfe", "utf-8:strict")  # strict: was UnicodeDecodeError
    typed = chat(script % "\ufffd\ufffd".encode(), "utf-8")
    assert bad.returncode == 0, bad.stderr.decode()
    assert b"Traceback" not in bad.stderr
    note = b"(the line held 2 bytes that are not UTF-8; each was replaced by U+FFFD)"
    assert note in bad.stderr.splitlines()
    # the replies, and the context the three turns used (/stats; its speeds vary from run to run)
    *replies, stats = bad.stdout.decode().splitlines()
    *typed_replies, typed_stats = typed.stdout.decode().splitlines()
    assert replies == typed_replies and len(replies) >= 3
    assert stats.startswith("prefill: ") and " context: " in stats
    assert stats.split(" context: ")[1] == typed_stats.split(" context: ")[1]
