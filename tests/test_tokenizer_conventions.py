"""TextTokenizer encodes and decodes as transformers' AutoTokenizer does, for each tokenizer convention in use.

Small tokenizers of each convention are trained here on a few sentences with the ``tokenizers`` library and saved
with a matching ``tokenizer_config.json``: Llama-3 (PreTrainedTokenizerFast, ByteLevel, a TemplateProcessing that
adds BOS), a Llama-2 checkpoint converted to a fast tokenizer (LlamaTokenizerFast, byte-fallback BPE, ``<s>`` from
the post-processor), Qwen2 (no BOS at all), a WordLevel one whose decoder joins tokens with spaces, and the
``add_bos_token`` / ``add_eos_token`` variants. No network.
"""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from frontend.chat_template import ChatTemplate
from modeling.tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(REPO, "models", "stdlib-llama-15m")

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Héllo wörld, naïve café 日本語 ✓ and more words",
          "def f(x):\n    return x * 2  # double it", "  leading spaces and\ttabs\n\nnew lines", "hello world hi"] * 3
TEXTS = ["", " ", "a", "hello world", "  two  spaces\n\nnew line", "Héllo wörld 日本語 ✓ 🙂 ŧ€ zq",
         "<|begin_of_text|>hi<|eot_id|>", "<s>[INST] hi [/INST]", "x</s>y <|im_start|>user\nhi<|im_end|>",
         "cafe\u0301 1234567"]

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA2_CHAT = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


# -- building checkpoints of each convention -----------------------------------------------------------------


def byte_level_bpe(specials: list[str], split: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def llama3_tokenizer(post: str = "template") -> Tokenizer:
    tok = byte_level_bpe(LLAMA3_SPECIALS, LLAMA3_SPLIT)
    bos = ("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))
    template = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[bos],
                                             pair="<|begin_of_text|> $A:0 <|begin_of_text|>:1 $B:1")
    tok.post_processor = {"template": processors.Sequence([processors.ByteLevel(trim_offsets=False), template]),
                          "bytelevel": processors.ByteLevel(trim_offsets=False), "none": None}[post]
    return tok


def llama2_tokenizer(legacy_normalizer: bool) -> Tokenizer:
    """A converted Llama-2 tokenizer: <unk> <s> </s>, 256 byte tokens, then merged pieces; byte-fallback BPE."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if legacy_normalizer:  # what convert_slow_tokenizer wrote for Llama-2 (legacy): ▁ prepended to every segment
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def qwen2_tokenizer(nfc: bool = True) -> Tokenizer:
    tok = byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN2_SPLIT)
    tok.normalizer = normalizers.NFC() if nfc else None  # Qwen2Tokenizer applies NFC whatever the file says
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def word_level_tokenizer() -> Tokenizer:
    """No decoder: tokenizers joins decoded tokens with spaces. <a> <b> special, <tool> a plain added token."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<a>", "<b>"],
                                                              show_progress=False))
    tok.add_tokens(["<tool>"])
    return tok


def truncating(tok: Tokenizer) -> Tokenizer:
    tok.enable_truncation(max_length=3)  # stored in tokenizer.json; transformers does not truncate by default
    return tok


def save(directory, tok: Tokenizer, config: dict, model_type: str | None = None) -> str:
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    files = {"tokenizer_config.json": {k: v for k, v in config.items() if k != "special_tokens_map"},
             "special_tokens_map.json": config.get("special_tokens_map"),
             "config.json": model_type and {"model_type": model_type}}
    for name, content in files.items():
        if content is not None:
            with open(os.path.join(directory, name), "w") as f:
                json.dump(content, f)
    return str(directory)


LLAMA3_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                 "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True, "chat_template": LLAMA3_CHAT}
LLAMA2_CONFIG = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                 "pad_token": None, "add_bos_token": True, "add_eos_token": False, "legacy": False,
                 "clean_up_tokenization_spaces": False, "chat_template": LLAMA2_CHAT}
QWEN2_CONFIG = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False, "errors": "replace",
                "split_special_tokens": False, "chat_template": CHATML}

# name -> (tokenizer builder, tokenizer_config.json, config.json model_type, encode adds BOS)
CONVENTIONS = {
    "llama3": (llama3_tokenizer, LLAMA3_CONFIG, "llama", True),
    "llama3_add_bos_false": (llama3_tokenizer, {**LLAMA3_CONFIG, "add_bos_token": False}, "llama", True),
    "llama3_add_bos_eos_true": (llama3_tokenizer, {**LLAMA3_CONFIG, "add_bos_token": True, "add_eos_token": True},
                                None, True),
    "llama3_no_template_add_bos_true": (lambda: llama3_tokenizer("bytelevel"),
                                        {**LLAMA3_CONFIG, "add_bos_token": True}, None, False),
    "llama3_no_post_processor": (lambda: llama3_tokenizer("none"), LLAMA3_CONFIG, None, False),
    "llama3_declared_llama": (llama3_tokenizer, {**LLAMA3_CONFIG, "tokenizer_class": "LlamaTokenizerFast"},
                              "llama", True),
    "llama3_extra_specials": (llama3_tokenizer, {**LLAMA3_CONFIG, "additional_special_tokens": ["<|tool|>"],
                                                 "image_token": "<image>", "pad_token": "<|finetune_pad|>"},
                              None, True),
    "llama3_truncation_split_specials": (lambda: truncating(llama3_tokenizer()),
                                         {**LLAMA3_CONFIG, "split_special_tokens": True}, None, True),
    "llama3_special_tokens_map": (llama3_tokenizer, {
        "tokenizer_class": "PreTrainedTokenizerFast", "special_tokens_map": {
            "bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False}, "eos_token": "<|eot_id|>", "pad_token": "<|pad|>"}}, None, True),
    "llama2": (lambda: llama2_tokenizer(legacy_normalizer=True), LLAMA2_CONFIG, "llama", True),
    "llama2_metaspace_file": (lambda: llama2_tokenizer(legacy_normalizer=False), LLAMA2_CONFIG, None, True),
    "llama2_legacy": (lambda: llama2_tokenizer(legacy_normalizer=True), {**LLAMA2_CONFIG, "legacy": True}, None, True),
    "llama2_no_prefix_space": (lambda: llama2_tokenizer(legacy_normalizer=False),
                               {**LLAMA2_CONFIG, "add_prefix_space": False}, None, True),
    "llama2_add_bos_false_eos_true": (lambda: llama2_tokenizer(legacy_normalizer=True),
                                      {**LLAMA2_CONFIG, "add_bos_token": False, "add_eos_token": True}, None, True),
    "llama2_class_defaults": (lambda: llama2_tokenizer(legacy_normalizer=True),
                              {k: v for k, v in LLAMA2_CONFIG.items() if not k.endswith("_token")}, None, True),
    "qwen2": (qwen2_tokenizer, QWEN2_CONFIG, "qwen2", False),
    "qwen2_file_without_nfc": (lambda: qwen2_tokenizer(nfc=False), QWEN2_CONFIG, None, False),
    "qwen2_added_tokens_decoder": (qwen2_tokenizer, {**QWEN2_CONFIG, "added_tokens_decoder": {
        "0": {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
              "special": True},
        "1": {"content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": True, "single_word": False,
              "special": False},
        "900": {"content": "<think>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                "special": False}}}, "qwen2", False),
    "word_level": (word_level_tokenizer, {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
                                          "clean_up_tokenization_spaces": False}, None, False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tokenizers")
    made = {name: save(root / name, build(), config, model_type)
            for name, (build, config, model_type, _) in CONVENTIONS.items()}
    made["bundled"] = BUNDLED
    return made


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """name -> (ours, transformers'), loaded once."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # e.g. the ByteLevel-declared-as-Llama warning
    try:
        return {name: (TextTokenizer(d), transformers.AutoTokenizer.from_pretrained(d))
                for name, d in checkpoints.items()}
    finally:
        transformers.logging.set_verbosity(verbosity)


NAMES = [*CONVENTIONS, "bundled"]


def texts_for(name: str) -> list[str]:
    extra = ["<|tool|> and <image> and <|finetune_pad|>"] if name == "llama3_extra_specials" else []
    extra += ["<think>ok</think> <|pad|>"] if name.startswith(("qwen2_", "llama3_special")) else []
    return TEXTS + extra + ["<tool> <a><b> hello"] * (name == "word_level")


# -- encoding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_encode_matches_transformers(loaded, name):
    ours, hf = loaded[name]
    for text in texts_for(name):
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf(text, add_special_tokens=add).input_ids, (text, add)


@pytest.mark.parametrize("name", NAMES)
def test_bos_as_transformers_adds_it(loaded, name):
    ours, hf = loaded[name]
    adds_bos = CONVENTIONS[name][3] if name in CONVENTIONS else False
    assert ours.add_bos is adds_bos
    assert ours.bos_token_id == hf.bos_token_id
    ids = ours.encode("hello world")
    assert (ids[:1] == [hf.bos_token_id]) is adds_bos
    assert ids[ours.add_bos:] == ours.encode("hello world", add_special_tokens=False)


def test_named_conventions(loaded):
    """The cases the conventions are about, spelled out."""
    llama3, _ = loaded["llama3"]
    bos = llama3.bos_token_id
    assert llama3.encode("hi")[0] == bos and bos not in llama3.encode("hi", add_special_tokens=False)
    # transformers 5 ignores add_bos_token/add_eos_token when a tokenizer.json exists: the post-processor decides
    assert loaded["llama3_add_bos_false"][0].encode("hi")[0] == bos
    assert loaded["llama3_add_bos_eos_true"][0].encode("hi")[-1] != loaded["llama3_add_bos_eos_true"][1].eos_token_id
    llama2, _ = loaded["llama2_add_bos_false_eos_true"]
    assert llama2.encode("hi")[0] == 1 and llama2.encode("hi")[-1] != 2
    qwen2, _ = loaded["qwen2"]
    assert qwen2.bos_token_id is None and not qwen2.add_bos
    assert qwen2.encode("hi") == qwen2.encode("hi", add_special_tokens=False)
    # a special token that only tokenizer_config.json names maps to one id, as in transformers
    extra, hf = loaded["llama3_extra_specials"]
    assert extra.encode("<|tool|>", add_special_tokens=False) == [hf.convert_tokens_to_ids("<|tool|>")]


@pytest.mark.parametrize("name", ["llama3", "llama2", "qwen2", "bundled"])
def test_chat_prompt_has_exactly_one_bos(checkpoints, loaded, name):
    """A rendered chat prompt writes its own BOS text and is encoded without added special tokens."""
    ours, hf = loaded[name]
    conversation = [{"role": "user", "content": "hello wörld"}, {"role": "assistant", "content": "hi"},
                    {"role": "user", "content": "again"}]
    text = ChatTemplate.from_checkpoint(checkpoints[name]).render(conversation, True)
    ids = ours.encode(text, add_special_tokens=False)
    expected = hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == list(expected)
    if name.startswith("llama"):
        assert text.startswith(hf.bos_token) and ids[0] == ours.bos_token_id
        assert ids.count(ours.bos_token_id) == 1
    else:
        assert ours.bos_token_id not in ids[:1]


# -- decoding ------------------------------------------------------------------------------------------------


def decode_cases(ours: TextTokenizer, hf, name: str) -> list[list[int]]:
    cases = [hf(text).input_ids for text in texts_for(name)]
    specials = sorted(ours._added)
    cases.append(specials + cases[3] + specials[::-1] + cases[5])  # added tokens back to back, in and around text
    return cases


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_transformers(loaded, name):
    ours, hf = loaded[name]
    for ids in decode_cases(ours, hf, name):
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == expected
            if name != "word_level":  # the decoders here put no separator between added tokens
                assert ours.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=False) == expected


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("skip,spaces", [(True, True), (False, True), (False, False)])
def test_stream_deltas_concatenate_to_decode(loaded, name, skip, spaces):
    ours, hf = loaded[name]
    for ids in decode_cases(ours, hf, name):
        full = ours.decode(ids, skip, spaces)
        for step in (1, 3):
            stream = ours.stream(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            deltas = [stream.push(ids[i : i + step]) for i in range(0, len(ids), step)] + [stream.flush()]
            assert "".join(deltas) == full
            if "\ufffd" not in full:
                assert not any("\ufffd" in d for d in deltas)


def test_spaces_between_special_tokens_as_vllm(loaded):
    """With a decoder that joins tokens with spaces, spaces_between_special_tokens=False drops the space before an
    added token that follows another one (vLLM's FastIncrementalDetokenizer); transformers' fast decode ignores it."""
    ours, hf = loaded["word_level"]
    ids = ours.encode("hello <a><b><tool> world <b>", add_special_tokens=False)
    assert hf.decode(ids, skip_special_tokens=False) == "hello <a> <b> <tool> world <b>"
    assert ours.decode(ids, skip_special_tokens=False) == "hello <a> <b> <tool> world <b>"
    assert ours.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == \
        "hello <a><b><tool> world <b>"
    # skipping special tokens (not the plain added <tool>) makes the option moot, as in vLLM
    assert ours.decode(ids, True, False) == ours.decode(ids, True, True) == hf.decode(ids, skip_special_tokens=True)
