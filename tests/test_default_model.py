"""The bundled default model (models/stdlib-llama-15m) loads unchanged in HF transformers and agrees with us.

Checks the shipped files (config, bf16 safetensors, tokenizer configs, size), that HF's AutoTokenizer and
our TextTokenizer give the same ids on real text, and that our float32 logits match HF's on a few hundred
tokens of real Python source.
"""

from __future__ import annotations

import inspect
import json
import os
import textwrap

import pytest
import torch
from safetensors import safe_open

from modeling.checkpoint import load_model
from modeling.tokenizer import TextTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(REPO, "models", "stdlib-llama-15m")
EOS = "<|endoftext|>"

pytestmark = pytest.mark.skipif(not os.path.isdir(MODEL_DIR), reason=f"{MODEL_DIR} not present")


@pytest.fixture(scope="module")
def real_text() -> str:
    """Real Python source (a stdlib module) with some non-ASCII text appended."""
    return inspect.getsource(textwrap) + "\n# café, naïve, Straße, 日本語 — ok\n"


@pytest.fixture(scope="module")
def ours():
    return load_model(MODEL_DIR, dtype="float32")


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def read(name: str) -> dict:
    with open(os.path.join(MODEL_DIR, name), encoding="utf-8") as f:
        return json.load(f)


def test_shipped_files_and_config():
    cfg = read("config.json")
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] >= 100000
    assert cfg["rope_parameters"]["rope_type"] == "default"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # grouped-query attention
    assert cfg["max_position_embeddings"] >= 8192
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert read("generation_config.json")["eos_token_id"] == cfg["eos_token_id"]
    tok_cfg = read("tokenizer_config.json")
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_cfg["eos_token"] == EOS and tok_cfg["add_bos_token"] is False
    total = sum(os.path.getsize(os.path.join(MODEL_DIR, f)) for f in os.listdir(MODEL_DIR))
    assert total < 100 * 2**20
    with safe_open(os.path.join(MODEL_DIR, "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert os.path.isfile(os.path.join(MODEL_DIR, "MODEL_CARD.md"))


def test_our_loader_reads_it(ours):
    assert 10e6 <= ours.config.num_parameters() <= 40e6
    tok = TextTokenizer(MODEL_DIR)
    assert tok.vocab_size == ours.config.vocab_size
    assert ours.eos_token_ids == (tok._tok.token_to_id(EOS),)


def test_tokenizers_agree(real_text):
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    tok = TextTokenizer(MODEL_DIR)
    ids = tok.encode(real_text)
    assert len(ids) > 1000
    assert hf_tok(real_text)["input_ids"] == ids
    assert hf_tok.encode(real_text, add_special_tokens=False) == ids
    assert hf_tok.eos_token == EOS and hf_tok.eos_token_id == tok._tok.token_to_id(EOS)
    assert tok.decode(ids) == real_text == hf_tok.decode(ids)


def test_logits_match_hf(ours, hf, real_text):
    ids = torch.tensor([TextTokenizer(MODEL_DIR).encode(real_text)[:384]])
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = ours.model.forward_dense(ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-3
    # The model has learned something: the text (docstring-heavy) is far more likely than uniform.
    loss = torch.nn.functional.cross_entropy(got[0, :-1], ids[0, 1:]).item()
    assert loss < 0.65 * torch.log(torch.tensor(float(ours.config.vocab_size))).item()


def test_greedy_matches_hf_generate(ours, hf):
    prompt = TextTokenizer(MODEL_DIR).encode("def fibonacci(n):")
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(ours.model.forward_dense(torch.tensor([ids]))[0, -1].argmax()))
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert ref[0].tolist() == ids
