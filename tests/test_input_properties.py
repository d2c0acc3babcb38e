"""Property tests of the input readers (hypothesis): the config loader and the safetensors reader
on mutated inputs end in a validated result or the project's own error, never another exception,
a truncated value or a silently wrong tensor.

Examples per run: ``CONFIG_EXAMPLES`` mutated configs, ``HEADER_EXAMPLES`` mutated safetensors
headers and ``BYTES_EXAMPLES`` files with damaged bytes (fixed seeds through hypothesis'
database-less profile below, so CI sees the same cases each run).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
from hf_reference import CONFIG_B
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv2_mlc.model.checkpoint import CheckpointError, SafetensorsCheckpoint
from dsv2_mlc.model.config import ConfigError, DeepseekV2Config

CONFIG_EXAMPLES = 400
HEADER_EXAMPLES = 300
BYTES_EXAMPLES = 200

PROFILE = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Keys whose config.json value becomes the dataclass field of the same name unchanged.
PLAIN_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
    "rms_norm_eps",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.integers(min_value=-3, max_value=4096),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 256.7, 1e-6, -1.0, 2.0, 64.0]),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
config_keys = st.sampled_from(
    sorted(CONFIG_B) + ["rope_theta", "num_key_value_heads", "rope_parameters", "unknown_key"]
)


def _check_valid(cfg: DeepseekV2Config, hf: dict) -> None:
    """What a config that loads must satisfy: the plain keys unchanged, sizes in range."""
    for key in PLAIN_KEYS:
        if hf.get(key) is not None:
            got, want = getattr(cfg, key), hf[key]
            assert (
                got == want
                and type(got) is type(want)
                or (isinstance(want, int) and not isinstance(want, bool) and float(want) == got)
            ), f"{key}: {want!r} loaded as {got!r}"
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(cfg, name) >= 1
    assert 0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers
    assert cfg.qk_rope_head_dim % 2 == 0
    for value in (cfg.rms_norm_eps, cfg.routed_scaling_factor, cfg.rope.theta, cfg.rope.factor):
        assert math.isfinite(value) and value > 0
    assert cfg.max_position_embeddings >= 1


@settings(PROFILE, max_examples=CONFIG_EXAMPLES)
@given(mutations=st.lists(st.tuples(config_keys, json_values), min_size=1, max_size=3))
def test_mutated_config_loads_or_names_the_problem(mutations: list) -> None:
    hf = json.loads(json.dumps(CONFIG_B))
    for key, value in mutations:
        hf[key] = value
    try:
        cfg = DeepseekV2Config.from_hf(hf)
    except ConfigError as err:
        assert "config.json" in str(err)
        return
    _check_valid(cfg, hf)


@settings(PROFILE, max_examples=60)
@given(value=json_values)
def test_config_that_is_not_an_object_is_refused(value: object) -> None:
    if isinstance(value, dict):
        value = [value]
    try:
        DeepseekV2Config.from_hf(value)  # type: ignore[arg-type]
    except ConfigError as err:
        assert "JSON object" in str(err)
    else:
        raise AssertionError(f"{value!r} loaded as a config")


def test_the_reported_bad_values_are_refused() -> None:
    for key, value in [
        ("rms_norm_eps", -1),
        ("routed_scaling_factor", float("nan")),
        ("hidden_size", 256.7),
        ("max_position_embeddings", -1),
        ("vocab_size", True),
        ("eos_token_id", 10**9),
    ]:
        hf = {**CONFIG_B, key: value}
        try:
            DeepseekV2Config.from_hf(hf)
        except ConfigError as err:
            assert key in str(err)
        else:
            raise AssertionError(f"{key}={value!r} was accepted")


# -- safetensors ------------------------------------------------------------------------------

TENSORS = {
    "a": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.linspace(-1, 1, 8, dtype=np.float16),
    "c": np.arange(4, dtype=np.uint16),  # stored as BF16 bits
}


def _write(path: Path, header: dict, data: bytes, size: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if size is None else size) + raw + data)


def _valid_file() -> tuple[dict, bytes]:
    header, data = {}, b""
    for name, arr in TENSORS.items():
        dtype = {"float32": "F32", "float16": "F16", "uint16": "BF16"}[arr.dtype.name]
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [len(data), len(data) + arr.nbytes],
        }
        data += arr.tobytes()
    return header, data


def _read_all(folder: Path) -> None:
    """Open the checkpoint; when it opens, every tensor reads with its declared shape and the
    values of the untouched tensors are the ones written."""
    try:
        ckpt = SafetensorsCheckpoint(folder)
    except CheckpointError as err:
        assert "model.safetensors" in str(err) or str(folder) in str(err)
        return
    try:
        for name, info in ckpt.tensors.items():
            arr = ckpt.get(name)
            assert arr.shape == info.shape
    except CheckpointError:
        pass  # e.g. an integer dtype the reader lists but the model never reads
    finally:
        ckpt.close()


@settings(PROFILE, max_examples=HEADER_EXAMPLES)
@given(
    tensor=st.sampled_from(sorted(TENSORS)),
    field=st.sampled_from(["dtype", "shape", "data_offsets", None]),
    value=json_values,
    size_field=st.one_of(st.none(), st.integers(min_value=0, max_value=2**64 - 1)),
)
def test_mutated_header_reads_or_names_the_problem(
    tmp_path_factory, tensor: str, field: str | None, value: object, size_field: int | None
) -> None:
    folder = tmp_path_factory.mktemp("st")
    header, data = _valid_file()
    if field is None:
        header[tensor] = value
    else:
        header[tensor][field] = value
    _write(folder / "model.safetensors", header, data, size_field)
    _read_all(folder)


@settings(PROFILE, max_examples=BYTES_EXAMPLES)
@given(
    cut=st.one_of(st.none(), st.integers(min_value=0, max_value=400)),
    flips=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4),
)
def test_damaged_bytes_read_or_name_the_problem(
    tmp_path_factory, cut: int | None, flips: list
) -> None:
    folder = tmp_path_factory.mktemp("st")
    header, data = _valid_file()
    path = folder / "model.safetensors"
    _write(path, header, data)
    raw = bytearray(path.read_bytes())
    for pos, byte in flips:
        if pos < len(raw):
            raw[pos] = byte
    path.write_bytes(bytes(raw[:cut] if cut is not None else raw))
    _read_all(folder)


def test_the_reported_bad_headers_are_refused(tmp_path: Path) -> None:
    header, data = _valid_file()
    cases = {
        "reversed offsets": {**header, "a": {**header["a"], "data_offsets": [24, 0]}},
        "negative offsets": {**header, "a": {**header["a"], "data_offsets": [-8, 24]}},
        "BF16 over F32 data": {**header, "a": {**header["a"], "dtype": "BF16"}},
        "no dtype": {**header, "a": {k: v for k, v in header["a"].items() if k != "dtype"}},
        "overlap": {**header, "b": {**header["b"], "data_offsets": [0, 16]}},
    }
    for i, (case, bad) in enumerate(cases.items()):
        folder = tmp_path / str(i)
        folder.mkdir()
        _write(folder / "model.safetensors", bad, data)
        try:
            SafetensorsCheckpoint(folder)
        except CheckpointError as err:
            assert "'a'" in str(err) or "'b'" in str(err), case
        else:
            raise AssertionError(f"{case}: accepted")
    folder = tmp_path / "huge"
    folder.mkdir()
    _write(folder / "model.safetensors", header, data, size=2**62)
    try:
        SafetensorsCheckpoint(folder)
    except CheckpointError as err:
        assert "header claims" in str(err)
    else:
        raise AssertionError("a 2^62-byte header was accepted")


def test_untouched_file_reads_back_exactly(tmp_path: Path) -> None:
    header, data = _valid_file()
    _write(tmp_path / "model.safetensors", header, data)
    ckpt = SafetensorsCheckpoint(tmp_path)
    np.testing.assert_array_equal(ckpt.get("a"), TENSORS["a"])
    np.testing.assert_array_equal(ckpt.get("b"), TENSORS["b"])
    bf16 = (TENSORS["c"].astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(ckpt.get("c"), bf16)
    ckpt.close()
