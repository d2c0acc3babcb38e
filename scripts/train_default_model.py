"""Train dsv2-mlc's embedded default model: a tiny DeepSeek-V2 ("Coder-V2") on CPython's stdlib.

Everything comes from the machine: the corpus is the ``*.py`` source of the running interpreter's
standard library, the tokenizer is a byte-level BPE trained here, and the model is
``transformers.DeepseekV2ForCausalLM`` trained from scratch with torch on the CPU. See
``docs/default-model.md``. A run is reproducible given the same ``--steps``, ``--threads``, Python
(stdlib) version and torch version; ``--time-budget-min`` only picks ``--steps`` when it is omitted.

    OMP_NUM_THREADS=1 python scripts/train_default_model.py --out dsv2_mlc/default_model --steps N
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread, deterministic

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
EXCLUDED_DIRS = {"test", "tests", "site-packages", "idlelib", "pydoc_data", "__pycache__"}
HELDOUT_RULE = "int(sha256(relative_path.encode('utf-8')).hexdigest(), 16) % 20 == 0"
# "def " ends in a space, which the GPT-2 pre-split glues to the NEXT word: a rare token boundary.
PROMPTS = ["def main(", "class", "import os\n", "def "]


def model_config(vocab_size: int, bos_id: int, eos_id: int) -> dict:
    """The published-style ``config.json`` (``rope_scaling`` + ``rope_theta``, no ``head_dim``)."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 384,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "aux_loss_alpha": 0.01,
        "seq_aux": False,
        "ep_size": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "transformers_version": transformers.__version__,
    }


# -- corpus ------------------------------------------------------------------------------------
def collect_corpus(root: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """Sorted (relative path, text) of the stdlib's ``*.py`` files, and the skipped paths.

    Skipped: test/tests/idlelib/pydoc_data/site-packages folders, and the generated charmap codec
    tables in ``encodings/`` (files holding a ``decoding_table``), which are not code.
    """
    docs, skipped = [], []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if EXCLUDED_DIRS.intersection(rel.split("/")[:-1]):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if rel.startswith("encodings/") and "decoding_table = (" in text:
            skipped.append(rel)
            continue
        if text.strip():
            docs.append((rel, text))
    return docs, skipped


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode("utf-8")).hexdigest(), 16) % 20 == 0


def corpus_sha256(docs: list[tuple[str, str]]) -> str:
    """sha256 over ``path\\n text \\n`` of every file, in sorted order."""
    h = hashlib.sha256()
    for rel, text in docs:
        h.update(rel.encode() + b"\n" + text.encode("utf-8") + b"\n")
    return h.hexdigest()


# -- tokenizer ---------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-split), BOS/EOS with DeepSeek's spellings as ids 0 and 1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Like DeepSeek's tokenizer.json: no BOS template; callers prepend BOS themselves.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """BOS + tokens + EOS for every file, concatenated."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    return torch.tensor(ids, dtype=torch.long)


def save_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# -- training ----------------------------------------------------------------------------------
def balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """DeepSeek's expert-level balance loss (E/(K*T) * sum_i count_i * mean_prob_i), layer mean."""
    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(-1)
        n_exp = probs.shape[-1]
        idx = probs.topk(top_k, dim=-1).indices
        counts = F.one_hot(idx, n_exp).sum((0, 1)).float()
        frac = counts * n_exp / (top_k * probs.shape[0])
        losses.append((frac * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def lr_at(step: int, steps: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, lr: float, wd: float) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    groups = [{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model, opt, data, gen, args, lr) -> tuple[float, float]:
    starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=gen)
    x = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()])
    out = model(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
    loss = F.cross_entropy(out.logits.flatten(0, 1), x[:, 1:].flatten())
    aux = balance_loss(out.router_logits, model.config.num_experts_per_tok)
    for g in opt.param_groups:
        g["lr"] = lr
    (loss + args.aux_alpha * aux).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), aux.item()


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, max_windows: int | None = None):
    """Mean NLL over ``data`` in consecutive windows (every token but the first predicted once)."""
    model.eval()
    total, count, n = 0.0, 0, 0
    for s in range(0, len(data) - 1, seq_len):
        if max_windows is not None and n >= max_windows:
            break
        x = data[s : s + seq_len + 1].unsqueeze(0)
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        total += F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        count += x.shape[1] - 1
        n += 1
    model.train()
    return total / count, count


def calibrate_steps(model, data, gen_seed, args, elapsed: float, heldout_tokens: int) -> dict:
    """Time a few steps on a throw-away copy and size ``steps`` to the wall-time budget."""
    m = copy.deepcopy(model)
    opt = make_optimizer(m, args.lr, args.weight_decay)
    gen = torch.Generator().manual_seed(gen_seed + 999)
    times = []
    for _ in range(args.calib_steps):
        t = time.time()
        train_step(m, opt, data, gen, args, args.lr)
        times.append(time.time() - t)
    step_s = sorted(times[2:])[len(times[2:]) // 2]  # median after warm-up
    t = time.time()
    evaluate(m, data, args.seq_len, max_windows=4)
    eval_window_s = (time.time() - t) / 4
    del m, opt
    final_eval_s = eval_window_s * (heldout_tokens / args.seq_len + 1) * 1.5 + 60  # + save/samples
    calib_s = sum(times) + 4 * eval_window_s
    left = args.time_budget_min * 60 - elapsed - calib_s - final_eval_s
    per_step = step_s * 1.05 + args.eval_windows * eval_window_s / args.eval_every
    steps = max(50, int(left / per_step) // 50 * 50)
    return {"step_s": step_s, "eval_window_s": eval_window_s, "budget_left_s": left, "steps": steps}


# -- main --------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("dsv2_mlc/default_model"))
    p.add_argument("--steps", type=int, default=None, help="training steps (default: from budget)")
    p.add_argument("--time-budget-min", type=float, default=80.0, help="whole-run wall budget")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-alpha", type=float, default=0.01, help="expert balance loss weight")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows per eval")
    p.add_argument("--calib-steps", type=int, default=8)
    p.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    log["args"]["stdlib"] = "sysconfig stdlib"  # machine path left out of the committed log

    docs, skipped = collect_corpus(args.stdlib)
    train_docs = [(r, t) for r, t in docs if not is_heldout(r)]
    held_docs = [(r, t) for r, t in docs if is_heldout(r)]
    lines = [f"# held-out rule: {HELDOUT_RULE}", f"# {len(held_docs)} of {len(docs)} files"]
    (out / "heldout_files.txt").write_text("\n".join(lines + [r for r, _ in held_docs]) + "\n")
    log["corpus"] = {
        "source": "CPython stdlib *.py (sysconfig.get_paths()['stdlib'])",
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "skipped_files": skipped,
        "files": len(docs),
        "train_files": len(train_docs),
        "heldout_files": len(held_docs),
        "bytes": sum(len(t.encode()) for _, t in docs),
        "heldout_bytes": sum(len(t.encode()) for _, t in held_docs),
        "sha256": corpus_sha256(docs),
        "heldout_rule": HELDOUT_RULE,
    }
    print(f"corpus: {len(docs)} files ({len(held_docs)} held out)", flush=True)

    t = time.time()
    tok = train_tokenizer([x for _, x in train_docs], args.vocab_size)
    train_ids = encode_stream(tok, [x for _, x in train_docs])
    held_ids = encode_stream(tok, [x for _, x in held_docs])
    save_tokenizer(tok, out, 2048)
    log["tokenizer"] = {
        "vocab_size": tok.get_vocab_size(),
        "bos_id": tok.token_to_id(BOS),
        "eos_id": tok.token_to_id(EOS),
        "train_tokens": len(train_ids),
        "heldout_tokens": len(held_ids),
        "bytes_per_token": log["corpus"]["bytes"] / (len(train_ids) + len(held_ids)),
        "sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "seconds": round(time.time() - t, 1),
    }
    print(f"tokenizer: {log['tokenizer']}", flush=True)

    hf_cfg = model_config(tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS))
    config = transformers.DeepseekV2Config(**hf_cfg)
    torch.manual_seed(args.seed)
    model = transformers.DeepseekV2ForCausalLM(config).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log["model"] = {"params": n_params, "fp32_bytes": 4 * n_params}
    print(f"model: {n_params:,} parameters", flush=True)

    steps = args.steps
    if steps is None:
        cal = calibrate_steps(model, train_ids, args.seed, args, time.time() - t0, len(held_ids))
        steps = cal["steps"]
        log["calibration"] = cal
        print(f"calibration: {cal}", flush=True)
    log["steps"] = steps

    opt = make_optimizer(model, args.lr, args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    curve, evals, acc, acc_aux, t_train = [], [], [], [], time.time()
    for step in range(steps):
        lr = lr_at(step, steps, args.lr, args.warmup)
        loss, aux = train_step(model, opt, train_ids, gen, args, lr)
        acc.append(loss)
        acc_aux.append(aux)
        if (step + 1) % args.log_every == 0 or step + 1 == steps:
            rec = {
                "step": step + 1,
                "loss": round(sum(acc) / len(acc), 4),
                "aux": round(sum(acc_aux) / len(acc_aux), 4),
                "lr": round(lr, 6),
                "tokens": (step + 1) * args.batch * args.seq_len,
                "wall_s": round(time.time() - t_train, 1),
            }
            curve.append(rec)
            acc, acc_aux = [], []
            print(json.dumps(rec), flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            nll, _ = evaluate(model, held_ids, args.seq_len, args.eval_windows)
            evals.append({"step": step + 1, "heldout_loss_subset": round(nll, 4)})
            print(json.dumps(evals[-1]), flush=True)
    log["train_seconds"] = round(time.time() - t_train, 1)
    log["tokens_seen"] = steps * args.batch * args.seq_len
    log["loss_curve"] = curve
    log["heldout_subset_curve"] = evals

    model.generation_config.pad_token_id = config.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained writes the transformers-5 spelling; keep the published one.
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")

    log["final"] = final_eval(out, held_ids, args, log["corpus"]["heldout_bytes"])
    log["samples"] = samples(out, args.seed)
    log["output_bytes"] = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    log["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": sys.modules["tokenizers"].__version__,
        "threads": torch.get_num_threads(),
    }
    log["wall_seconds"] = round(time.time() - t0, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=1, ensure_ascii=False) + "\n")
    mb = sum(log["output_bytes"].values()) / 1e6
    print(f"done: {out} {mb:.2f} MB, held-out ppl {log['final']['heldout_ppl']}", flush=True)


def final_eval(out: Path, held_ids: torch.Tensor, args, heldout_bytes: int) -> dict:
    """Reload the saved checkpoint with HF (fp32) and score the whole held-out set."""
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    nll, count = evaluate(model, held_ids, args.seq_len)
    bits = nll * count / math.log(2)
    return {
        "heldout_loss": round(nll, 5),
        "heldout_ppl": round(math.exp(nll), 4),
        "heldout_predicted_tokens": count,
        "heldout_bits_per_byte": round(bits / heldout_bytes, 4),
        "window": args.seq_len,
        "dtype": "float32",
        "loader": "transformers.AutoModelForCausalLM.from_pretrained",
    }


def samples(out: Path, seed: int) -> list[dict]:
    """Greedy and temperature-0.8 continuations (BOS prepended; 64 new tokens)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    res = []
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([[bos, *tok.encode(prompt, add_special_tokens=False).ids]])
        for mode in ("greedy", "t0.8"):
            torch.manual_seed(seed + i)
            kw = {"do_sample": True, "temperature": 0.8, "top_k": 0} if mode != "greedy" else {}
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, pad_token_id=eos, **kw
            )
            text = tok.decode(gen[0, ids.shape[1] :].tolist(), skip_special_tokens=False)
            res.append({"prompt": prompt, "mode": mode, "completion": text})
    return res


if __name__ == "__main__":
    main()
