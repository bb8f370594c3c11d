"""Tiny random Hugging Face checkpoints for tests, written with transformers itself (the oracle)."""

from __future__ import annotations

import json
import os

import torch

VOCAB = 384

TINY_CONFIGS: dict[str, dict] = {
    # Llama with grouped-query attention (4 query heads share 2 KV heads)
    "llama_gqa": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    # Llama 3.1-style RoPE scaling, short original context so scaling matters at our lengths
    "llama3_rope": dict(
        model_type="llama", num_attention_heads=4, num_key_value_heads=1, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    # Qwen2: QKV bias, tied embeddings
    "qwen2_bias": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Llama with tied embeddings (Llama 3.2 style) and multi-query attention
    "llama_tied": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    # Mistral with sliding_window null (full attention)
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    # Mistral with a sliding window far shorter than the test prompts (every layer slides)
    "mistral_swa": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    # Qwen2 with sliding windows on the layers from max_window_layers on: layer 0 full, layer 1 sliding
    "qwen2_swa": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                      sliding_window=8, max_window_layers=1),
}


def build_checkpoint(name: str, directory: str, seed: int = 0, vocab: int = VOCAB) -> str:
    """Save a random tiny model of family ``name`` into ``directory``, with a byte-level BPE tokenizer
    when ``vocab`` is the default (a smaller vocabulary gives a token-ids-only checkpoint)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_CONFIGS[name])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=1024, eos_token_id=1, bos_token_id=0, **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init is small; scale up so logits are far from uniform and argmax is stable.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif "bias" in str(p):
                p.normal_(0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    if vocab == VOCAB:
        write_tokenizer(directory)
    return directory


def write_tokenizer(directory: str) -> None:
    """A byte-level BPE with VOCAB entries trained on a fixed text, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. " * 4,
            "import os\nimport sys\nprint('hello world')\n"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}, f)
