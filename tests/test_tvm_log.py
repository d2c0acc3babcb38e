"""A compile prints only the project's own output: TVM's known-benign C++ warnings are hidden, every
other stderr line still reaches the user (compiler/tvm_log.py)."""

from __future__ import annotations

import json
import os

from hf_reference import CONFIG_A

from dsv2_mlc.compiler import tvm_log
from dsv2_mlc.compiler.tvm_log import BENIGN_TVM_LINES, benign_tvm_lines_hidden

FAST_TAKE = "Fast mode segfaults when there are out-of-bounds indices"


def test_hides_only_the_benign_lines_written_to_fd_2(capfd):
    benign = f"[12:00:00] transform.h:1261: {BENIGN_TVM_LINES[0]}. Make sure ...\n".encode()
    with benign_tvm_lines_hidden():
        os.write(2, b"tvm: first other line\n")
        os.write(2, benign)
        os.write(2, b"tvm: last other line, no newline")
    assert capfd.readouterr().err == "tvm: first other line\ntvm: last other line, no newline"
    # negative control: outside the block the same write is seen
    os.write(2, benign)
    assert BENIGN_TVM_LINES[0] in capfd.readouterr().err


def test_lines_written_before_an_error_still_reach_stderr(capfd):
    try:
        with benign_tvm_lines_hidden():
            os.write(2, b"what went wrong\n")
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert capfd.readouterr().err == "what went wrong\n"


def test_a_cpu_compile_prints_no_tvm_warning(tmp_path, capfd, monkeypatch):
    from dsv2_mlc.compiler.compile import compile_random_model

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG_A))
    compile_random_model(config, tmp_path / "out")
    assert FAST_TAKE not in capfd.readouterr().err

    # negative control: with nothing hidden, TVM prints the warning (so the check above can fail)
    real = tvm_log.benign_tvm_lines_hidden
    monkeypatch.setattr(tvm_log, "benign_tvm_lines_hidden", lambda: real(hidden=()))
    compile_random_model(config, tmp_path / "out2")
    assert FAST_TAKE in capfd.readouterr().err
