"""Structured output through the decode worker's speculation, on the bundled model: greedy output under a
grammar is token-identical with speculation on (drafts under the grammar, or masked at verification only)
and off, and equal to the reference engine's; sampled output under a grammar has plain constrained
decoding's distribution (two-sample chi-square); grammar-aware drafts are accepted more often."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from decode_worker.config import DecodeWorkerConfig, SpeculationConfig  # noqa: E402
from decode_worker.worker import DecodeWorker  # noqa: E402
from modeling.engine import EngineConfig, ReferenceEngine  # noqa: E402
from modeling.sampling import SamplingParams  # noqa: E402
from modeling.structured_output import StructuredOutput  # noqa: E402
from modeling.tokenizer import TextTokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "level": {"enum": ["debug", "info", "error"]},
    "codes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 5}},
    "required": ["name", "level", "codes"], "additionalProperties": False}
PROMPTS = ["import json\n\ndef load(path):\n    with open(path) as f:\n        return json.",
           "class Config:\n    def __init__(self, name, level):\n        self.name = name\n",
           "# settings as JSON\nDEFAULTS = "]


def worker(spec: SpeculationConfig, max_num_seqs: int = 8) -> DecodeWorker:
    cfg = DecodeWorkerConfig(dtype="float32", kv_cache_tokens=16384, max_num_seqs=max_num_seqs,
                             attention_backend="torch", profile_on_start=False, speculation=spec)
    return DecodeWorker(DEFAULT_MODEL_DIR, cfg)


def run(w: DecodeWorker, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs: dict[str, list[int]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        for d in w.add_local(f"r{i}", p, sp):
            outs.setdefault(d.request_id, []).extend(d.token_ids)
    while w.has_work():
        for d in w.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer(DEFAULT_MODEL_DIR)


SPECS = {"off": SpeculationConfig(drafter="none"),
         "grammar_drafts": SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=4, budget=24, sink_tokens=4),
         "target_only": SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=4, budget=24, sink_tokens=4,
                                          grammar_drafts=False)}


def test_greedy_under_a_grammar_is_identical_with_speculation_on_and_off(tokenizer):
    """Three constrained requests and one unconstrained beside them in one batch."""
    structured = StructuredOutput.json_schema(SCHEMA)
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [tokenizer.encode(PROMPTS[0])]
    params = [SamplingParams(max_tokens=80, structured=structured)] * 3 + [SamplingParams(max_tokens=40)]
    engine = ReferenceEngine(DEFAULT_MODEL_DIR, EngineConfig(dtype="float32", kv_cache_tokens=16384,
                                                             attention_backend="torch"))
    reference = [c.token_ids for c in engine.generate(prompts, params)]
    acceptance = {}
    for name, spec in SPECS.items():
        w = worker(spec)
        assert run(w, prompts, params) == reference, name
        acceptance[name] = w.metrics.accepted_tokens / max(1, w.metrics.draft_tokens)
    for out in reference[:3]:
        jsonschema.validate(json.loads(tokenizer.decode(out)), SCHEMA)
    assert "def" in tokenizer.decode(reference[3]) or reference[3] != reference[0]  # the free one is not JSON
    # drafts the grammar shaped are kept more often than drafts it would have refused
    assert acceptance["grammar_drafts"] > acceptance["target_only"]


def histogram(spec: SpeculationConfig, prompt: list[int], structured: StructuredOutput, n: int,
              tokenizer: TextTokenizer) -> tuple[list[str], object]:
    """The outputs of ``n`` seeded sampling requests (temperature 1) under ``structured``, and the metrics."""
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=50_000 + i, structured=structured) for i in range(n)]
    w = worker(spec, max_num_seqs=64)
    texts = []
    for start in range(0, n, 64):
        texts += [tokenizer.decode(o) for o in run(w, [prompt] * len(params[start:start + 64]), params[start:start + 64])]
    return texts, w.metrics


def chi_square_same(a: list[str], b: list[str]) -> tuple[float, float, int]:
    """Two-sample chi-square of two samples' outcome counts (outcomes seen fewer than 10 times together
    merged into one bin): (statistic, critical value at p = 0.001, bins)."""
    keys = sorted(set(a) | set(b))
    rows = torch.tensor([[a.count(k) for k in keys], [b.count(k) for k in keys]], dtype=torch.float64)
    common = rows.sum(0) >= 10
    rows = torch.cat([rows[:, common], rows[:, ~common].sum(1, keepdim=True)], dim=1)
    rows = rows[:, rows.sum(0) > 0]
    expected = rows.sum(1, keepdim=True) * rows.sum(0, keepdim=True) / rows.sum()
    chi2 = float((((rows - expected) ** 2) / expected).sum())
    dof = rows.shape[1] - 1
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3  # Wilson-Hilferty
    return chi2, crit, rows.shape[1]


def test_sampling_under_a_grammar_has_plain_constrained_decodings_distribution(tokenizer):
    """Two-sample chi-square, per number, over the outputs of a two-number regex: speculation with drafts
    under the grammar (a sparse draft that disagrees with the target, so drafts are rejected too) vs plain
    constrained decoding."""
    structured = StructuredOutput("regex", r"[0-9]{1,2}, [0-9]{1,2}")
    prompt = tokenizer.encode(PROMPTS[0] + PROMPTS[1])
    n = 256
    sparse = SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=3, budget=8, sink_tokens=2)
    plain, _ = histogram(SPECS["off"], prompt, structured, n, tokenizer)
    spec, metrics = histogram(sparse, prompt, structured, n, tokenizer)
    assert 0 < metrics.accepted_tokens < metrics.draft_tokens
    for j in (0, 1):
        chi2, crit, bins = chi_square_same([t.split(", ")[j] for t in plain], [t.split(", ")[j] for t in spec])
        assert bins >= 4, bins  # a distribution with several outcomes, not one answer
        assert chi2 < crit, (j, chi2, crit)
