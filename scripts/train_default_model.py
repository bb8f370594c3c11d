#!/usr/bin/env python3
"""Train magicserve's bundled default model: a small Llama on the Python standard library's sources.

One command, reproducible end to end (fixed seeds, fixed step counts)::

    PYTHONPATH=. python scripts/train_default_model.py            # from scratch
    PYTHONPATH=. python scripts/train_default_model.py --resume   # continue from runs/<name>/ckpt.pt

Stages:
  1. corpus: ``*.py`` files of the stdlib (see ``scripts/_corpus.py``), split train / held-out by path hash;
  2. tokenizer: byte-level BPE (``tokenizers``), ``<|endoftext|>`` separates documents and is EOS;
  3. model: Llama with grouped-query attention, tied embeddings, RoPE theta 500000;
  4. training on CPU: bf16 autocast, fp32 master weights, AdamW, one warmup + cosine over the whole run;
     first ``short_steps`` at ``short_seq_len`` tokens on random windows of the token stream, then
     ``long_steps`` at ``long_seq_len`` on windows that lie inside one long file, so positions up to 4K
     are in distribution and every position's context is the same document; a checkpoint every
     ``ckpt_every`` steps;
  5. export: Hugging Face Llama directory (bf16 safetensors, tokenizer, configs) to ``models/<name>/``.

Scratch files (token cache, checkpoints, logs) go to ``runs/<name>/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _corpus import EOS_TOKEN, Document, corpus_stats, load_documents, split_documents, stdlib_dir  # noqa: E402

from modeling.config import ModelConfig  # noqa: E402
from modeling.model import CausalLM  # noqa: E402

DEFAULT_NAME = "stdlib-llama-15m"


@dataclass(frozen=True)
class ModelShape:
    """Architecture hyper-parameters (written to config.json)."""

    vocab_size: int = 4096
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    # serving limit written to config.json: trained at <= 4096 and evaluated to 8192; 16384 lets
    # the serving stack take 8K prompts plus generation (quality past 8K is not measured)
    max_position_embeddings: int = 16384
    tie_word_embeddings: bool = True


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained weights. Step counts are fixed, never time-based."""

    name: str = DEFAULT_NAME
    seed: int = 1234
    holdout_permille: int = 40  # 4 % of files held out for evaluation
    model: ModelShape = field(default_factory=ModelShape)
    # Phase 1: short sequences, random windows of the concatenated token stream.
    short_seq_len: int = 512
    short_batch: int = 16
    short_steps: int = 760
    # Phase 2: long sequences (positions up to long_seq_len in distribution), each window inside one
    # training file of at least long_seq_len + 1 tokens (a random stream offset straddles a document
    # boundary in a good share of 4K windows, and then the context beyond the boundary is useless).
    # Files are drawn in proportion to their length; a window starts at the file's first token with
    # probability file_start_share (where imports and definitions that the rest of the file uses live),
    # else at a uniform offset.
    long_seq_len: int = 4096
    long_batch: int = 2
    long_micro_batch: int = 1  # gradient accumulation: long_batch / long_micro_batch micro-steps
    long_steps: int = 460
    file_start_share: float = 0.25
    # Optimiser.
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    init_std: float = 0.02
    # Bookkeeping.
    ckpt_every: int = 50
    eval_every: int = 200
    eval_batches: int = 4

    @property
    def total_steps(self) -> int:
        return self.short_steps + self.long_steps


# --------------------------------------------------------------------------------------------------
# Tokenizer and data


def train_tokenizer(docs: list[Document], vocab_size: int) -> Tokenizer:
    """Byte-level BPE on the training documents; ``<|endoftext|>`` gets id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    return tok


def tokenize_stream(tok: Tokenizer, docs: list[Document]) -> np.ndarray:
    """All documents as one uint16 stream, each followed by EOS."""
    eos = tok.token_to_id(EOS_TOKEN)
    parts: list[np.ndarray] = []
    for enc in tok.encode_batch([d.text for d in docs], add_special_tokens=False):
        parts.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return np.concatenate(parts)


def prepare_data(cfg: TrainConfig, run_dir: str, log) -> tuple[Tokenizer, np.ndarray, np.ndarray, dict]:
    """Corpus -> tokenizer -> token streams, cached in ``run_dir`` (rebuilt identically when missing)."""
    tok_path = os.path.join(run_dir, "tokenizer.json")
    train_path = os.path.join(run_dir, "train_tokens.npy")
    held_path = os.path.join(run_dir, "heldout_tokens.npy")
    docs = load_documents()
    train_docs, held_docs = split_documents(docs, cfg.holdout_permille)
    info = {
        "stdlib_dir": stdlib_dir(),
        "python_version": sys.version.split()[0],
        "all": corpus_stats(docs),
        "train": corpus_stats(train_docs),
        "heldout": corpus_stats(held_docs),
    }
    if os.path.isfile(tok_path):
        tok = Tokenizer.from_file(tok_path)
        log(f"tokenizer: reusing {tok_path}")
    else:
        t0 = time.time()
        tok = train_tokenizer(train_docs, cfg.model.vocab_size)
        tok.save(tok_path)
        log(f"tokenizer: trained in {time.time() - t0:.0f}s, vocab {tok.get_vocab_size()}")
    if os.path.isfile(train_path) and os.path.isfile(held_path):
        train_tokens, held_tokens = np.load(train_path), np.load(held_path)
    else:
        t0 = time.time()
        train_tokens, held_tokens = tokenize_stream(tok, train_docs), tokenize_stream(tok, held_docs)
        np.save(train_path, train_tokens)
        np.save(held_path, held_tokens)
        log(f"tokenized in {time.time() - t0:.0f}s")
    info["train"]["tokens"] = int(train_tokens.size)
    info["heldout"]["tokens"] = int(held_tokens.size)
    log(f"corpus: {json.dumps(info)}")
    return tok, train_tokens, held_tokens, info


def sample_batch(tokens: np.ndarray, batch: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """Deterministic random windows of ``seq_len + 1`` tokens for ``step`` (independent of resume)."""
    gen = np.random.default_rng([seed, step, seq_len])
    starts = gen.integers(0, tokens.size - seq_len - 1, size=batch)
    rows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def document_spans(tokens: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the documents of an EOS-separated stream; lengths exclude the EOS."""
    ends = np.flatnonzero(tokens == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return starts, ends - starts


def sample_file_windows(tokens: np.ndarray, spans: tuple[np.ndarray, np.ndarray], batch: int, seq_len: int,
                        start_share: float, seed: int, step: int) -> torch.Tensor:
    """Deterministic windows of ``seq_len + 1`` tokens, each inside one document of the stream.

    Only documents with at least ``seq_len + 1`` tokens are eligible; one is drawn with probability
    proportional to its length, and the window starts at its first token with probability
    ``start_share``, else at a uniform offset."""
    doc_starts, doc_lens = spans
    eligible = np.flatnonzero(doc_lens >= seq_len + 1)
    if eligible.size == 0:
        raise ValueError(f"no training document has {seq_len + 1} tokens; lower long_seq_len")
    gen = np.random.default_rng([seed, step, seq_len, 4])
    weights = doc_lens[eligible] / doc_lens[eligible].sum()
    docs = gen.choice(eligible, size=batch, p=weights)
    rows = []
    for d in docs:
        at_start = gen.random() < start_share
        offset = 0 if at_start else int(gen.integers(0, doc_lens[d] - seq_len))
        begin = doc_starts[d] + offset
        rows.append(tokens[begin : begin + seq_len + 1])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


# --------------------------------------------------------------------------------------------------
# Model


def hf_config(cfg: TrainConfig, eos_id: int) -> dict:
    """The config.json of the exported checkpoint (readable by old and new transformers, vLLM, us)."""
    m = cfg.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": m.rms_norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": m.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": m.tie_word_embeddings,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def build_model(cfg: TrainConfig, eos_id: int) -> CausalLM:
    """A freshly initialised model: N(0, std) weights, residual projections scaled by 1/sqrt(2L)."""
    torch.manual_seed(cfg.seed)
    model = CausalLM(ModelConfig.from_hf_dict(hf_config(cfg, eos_id)))
    residual_std = cfg.init_std / math.sqrt(2 * cfg.model.num_hidden_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(param)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(param)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(param, std=residual_std)
        else:
            torch.nn.init.normal_(param, std=cfg.init_std)
    return model


def make_optimizer(model: CausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms and biases."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then one cosine to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - 1 - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def phase_of(step: int, cfg: TrainConfig) -> tuple[int, int, int]:
    """(seq_len, batch, micro_batch) of ``step``."""
    if step < cfg.short_steps:
        return cfg.short_seq_len, cfg.short_batch, cfg.short_batch
    return cfg.long_seq_len, cfg.long_batch, cfg.long_micro_batch


def lm_loss(model: CausalLM, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of rows [B, S+1] under bf16 autocast (loss in float32)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.forward_dense(rows[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model: CausalLM, held: np.ndarray, cfg: TrainConfig, seq_len: int) -> float:
    """Mean loss on ``eval_batches`` fixed held-out windows (4 rows each)."""
    model.eval()
    losses = [lm_loss(model, sample_batch(held, 4, seq_len, cfg.seed + 1, i)).item() for i in range(cfg.eval_batches)]
    model.train()
    return float(np.mean(losses))


def train_step(model, opt, tokens: np.ndarray, spans, step: int, cfg: TrainConfig) -> tuple[float, float]:
    """One optimiser step (with gradient accumulation in the long phases). Returns (loss, grad norm).

    ``spans`` are the stream's ``document_spans`` (phase 2 samples windows inside documents)."""
    seq_len, batch, micro = phase_of(step, cfg)
    if step >= cfg.short_steps:
        rows = sample_file_windows(tokens, spans, batch, seq_len, cfg.file_start_share, cfg.seed, step)
    else:
        rows = sample_batch(tokens, batch, seq_len, cfg.seed, step)
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    total = 0.0
    for chunk in rows.split(micro):
        loss = lm_loss(model, chunk) * (chunk.shape[0] / batch)
        loss.backward()
        total += loss.item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total, float(norm)


# --------------------------------------------------------------------------------------------------
# Checkpoints and export


def save_checkpoint(path: str, model: CausalLM, opt, step: int, elapsed: float, cfg: TrainConfig) -> None:
    """Atomic training checkpoint (fp32 weights, optimiser state, next step, wall time so far)."""
    tmp = path + ".tmp"
    state = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "step": step,
        "elapsed": elapsed,
        "cfg": dataclasses.asdict(cfg),
    }
    torch.save(state, tmp)
    os.replace(tmp, path)


def export_hf(model: CausalLM, tok: Tokenizer, cfg: TrainConfig, out_dir: str) -> None:
    """Write the Hugging Face directory: config, bf16 safetensors, tokenizer files, generation config."""
    os.makedirs(out_dir, exist_ok=True)
    eos_id = tok.token_to_id(EOS_TOKEN)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.hf_state_dict().items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    files = {
        "config.json": hf_config(cfg, eos_id),
        "generation_config.json": {
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
            "do_sample": False,
        },
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": cfg.model.max_position_embeddings,
        },
        "special_tokens_map.json": {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN},
    }
    for name, content in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
            f.write("\n")


# --------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resume", action="store_true", help="continue from runs/<name>/ckpt.pt")
    parser.add_argument("--name", default=DEFAULT_NAME, help="model name (models/<name>, runs/<name>)")
    parser.add_argument("--out", default=None, help="export directory (default: models/<name>)")
    parser.add_argument("--run-dir", default=None, help="scratch directory (default: runs/<name>)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this step (calibration only)")
    parser.add_argument("--no-export", action="store_true", help="do not write the HF directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = TrainConfig(name=args.name)
    torch.set_num_threads(args.threads)
    run_dir = args.run_dir or os.path.join(REPO, "runs", cfg.name)
    out_dir = args.out or os.path.join(REPO, "models", cfg.name)
    os.makedirs(run_dir, exist_ok=True)
    log_path = os.path.join(run_dir, "train_log.jsonl")

    def log(msg: str) -> None:
        tqdm.write(msg)
        with open(os.path.join(run_dir, "train.log"), "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {msg}\n")

    log(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    tok, train_tokens, held_tokens, corpus_info = prepare_data(cfg, run_dir, log)
    eos_id = tok.token_to_id(EOS_TOKEN)
    spans = document_spans(train_tokens, eos_id)
    model = build_model(cfg, eos_id)
    opt = make_optimizer(model, cfg)
    log(f"model: {model.config.num_parameters() / 1e6:.2f}M parameters")

    ckpt_path = os.path.join(run_dir, "ckpt.pt")
    start, elapsed = 0, 0.0
    if args.resume and os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, elapsed = state["step"], state["elapsed"]
        log(f"resumed at step {start} ({elapsed / 60:.1f} min of training so far)")
    elif os.path.exists(log_path):
        os.remove(log_path)

    end = min(cfg.total_steps, args.max_steps or cfg.total_steps)
    model.train()
    bar = tqdm(range(start, end), initial=start, total=cfg.total_steps, desc="train", dynamic_ncols=True)
    t_last = time.time()
    for step in bar:
        loss, norm = train_step(model, opt, train_tokens, spans, step, cfg)
        now = time.time()
        elapsed += now - t_last
        t_last = now
        seq_len, batch, _ = phase_of(step, cfg)
        record = {"step": step, "loss": loss, "grad_norm": norm, "lr": lr_at(step, cfg), "seq_len": seq_len,
                  "tokens": seq_len * batch, "elapsed": elapsed}
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{record['lr']:.2e}", seq=seq_len)
        done = step + 1
        if done % cfg.eval_every == 0 or done in (cfg.total_steps, cfg.short_steps):
            record["heldout_loss_512"] = heldout_loss(model, held_tokens, cfg, 512)
            if done > cfg.short_steps:
                record["heldout_loss_4096"] = heldout_loss(model, held_tokens, cfg, 4096)
            log(f"step {done}: train {loss:.3f}  held-out@512 {record['heldout_loss_512']:.3f}  "
                f"held-out@4096 {record.get('heldout_loss_4096', float('nan')):.3f}  ({elapsed / 60:.1f} min)")
            t_last = time.time()  # evaluation time is not training time
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if done % cfg.ckpt_every == 0 or done == end:
            save_checkpoint(ckpt_path, model, opt, done, elapsed, cfg)
            t_last = time.time()
    bar.close()

    if end < cfg.total_steps or args.no_export:
        log(f"stopped at step {end} (not exporting)")
        return
    summary = {
        "config": dataclasses.asdict(cfg),
        "corpus": corpus_info,
        "parameters": model.config.num_parameters(),
        "training_wall_time_s": elapsed,
        "train_tokens_seen": cfg.short_steps * cfg.short_seq_len * cfg.short_batch
        + cfg.long_steps * cfg.long_seq_len * cfg.long_batch,
        "final_heldout_loss_512": heldout_loss(model, held_tokens, cfg, 512),
        "final_heldout_loss_4096": heldout_loss(model, held_tokens, cfg, 4096),
        "torch": torch.__version__,
    }
    with open(os.path.join(run_dir, "train_summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    export_hf(model, tok, cfg, out_dir)
    log(f"done: {elapsed / 60:.1f} min of training; exported to {out_dir}; {json.dumps(summary)}")


if __name__ == "__main__":
    main()
