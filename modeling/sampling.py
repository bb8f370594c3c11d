"""Token selection (sampling parameters and their validation: ``modeling/params.py``).

One request's tokens are chosen from the target model's logits in three stages, the same at every position
whether it is decoded plainly, drafted or verified (so speculation is lossless under every parameter):

* :func:`processed_logits`: logit bias, min_tokens, and the penalties over the tokens before each position
  (rows of one call may each see a few more tokens: the draft tokens before a speculated position);
* greedy selection is the argmax of the processed logits;
* :func:`target_probs`: temperature, min_p, top-k, top-p: the exact distribution a sampled token is drawn from.

A request with structured output also carries its grammar matcher (``modeling/grammar.py``): its mask is
applied to the processed logits before the argmax or the temperature, at every position (a speculation step
takes the masks along its draft path: ``grammar.DraftPath``). The matcher advances with every token the
sequence keeps (``Sequence.append_token``).

Randomness comes from one ``torch.Generator`` per request, seeded from ``seed`` when given: the same seed
gives the same output whatever else is in the batch. :func:`token_logprobs` reports log-probabilities of
the raw logits (``modeling/logprobs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from typing import Sequence as Seq

import torch

from modeling.forks import fork_seed
from modeling.grammar import GrammarMatcher, constrain
from modeling.logprobs import TokenLogprob
from modeling.params import SamplingParams

if TYPE_CHECKING:
    from modeling.checkpoint import LoadedModel


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator; an unseeded request gets a fresh random seed."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return gen


@dataclass
class RequestSampler:
    """Per-request sampling state: parameters, the generator that makes it reproducible, and what the
    logits processing needs of the request (its prompt for the repetition penalty, the ids that
    ``min_tokens`` holds back)."""

    params: SamplingParams
    generator: torch.Generator = field(repr=False, default=None)
    prompt_ids: Seq[int] = field(repr=False, default=())
    eos_token_ids: frozenset[int] = frozenset()
    grammar: GrammarMatcher | None = field(repr=False, default=None)
    _prompt_ids_tensor: torch.Tensor | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.generator is None:
            self.generator = make_generator(self.params.seed)

    @property
    def held_back_ids(self) -> list[int]:
        """Token ids masked while fewer than ``min_tokens`` tokens are out: the stop token ids and, unless
        ``ignore_eos``, EOS."""
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids |= set(self.eos_token_ids)
        return sorted(ids)

    def prompt_tensor(self, device: torch.device) -> torch.Tensor:
        if self._prompt_ids_tensor is None or self._prompt_ids_tensor.device != device:
            self._prompt_ids_tensor = torch.tensor(sorted(set(self.prompt_ids)), dtype=torch.int64, device=device)
        return self._prompt_ids_tensor

    def for_sequence(self, index: int) -> "RequestSampler":
        """The sampler of the request's sequence ``index`` (``n`` > 1): the same parameters, its own
        generator (``modeling/forks.py``)."""
        if index == 0:
            return self
        gen = make_generator(fork_seed(self.params.seed, index), self.generator.device)
        grammar = None if self.grammar is None else self.grammar.copy()
        return RequestSampler(self.params, gen, self.prompt_ids, self.eos_token_ids, grammar)

    def catch_up(self, output_ids: Seq[int]) -> None:
        """The sequence was given ``output_ids`` at once (a migration's arrival): the grammar follows them."""
        if self.grammar is not None:
            for token in output_ids:
                self.grammar.advance(token)

    def choose(self, logits: torch.Tensor, tokens: Seq[int]) -> int:
        """logits: float32 [V] at the position after ``tokens`` (the sequence so far, prompt first) -> the next
        token id."""
        row = processed_logits(self, logits.unsqueeze(0), tokens)
        if self.grammar is not None:
            row = constrain(row, self.grammar.allowed().unsqueeze(0))
        if self.params.greedy:
            return int(torch.argmax(row[0]).item())
        return sample_from(target_probs(row, self.params)[0], self.generator)


def sampler_for(loaded: LoadedModel, params: SamplingParams, prompt_ids: Seq[int]) -> RequestSampler:
    """A new request's sampler on a worker serving ``loaded``, with its grammar's matcher when the request
    asks for structured output (compiled once per distinct grammar in this process)."""
    eos = frozenset(loaded.eos_token_ids)
    grammar = None
    if params.structured is not None:
        from modeling.grammar import compiler_for

        compiler = compiler_for(loaded.path, loaded.config.vocab_size, tuple(sorted(eos)))
        grammar = compiler.matcher(params.structured)
    return RequestSampler(params, prompt_ids=prompt_ids, eos_token_ids=eos, grammar=grammar)


def processed_logits(sampler: RequestSampler, logits: torch.Tensor, tokens: Seq[int],
                     drafted: Seq[int] = ()) -> torch.Tensor:
    """Logit bias, min_tokens and penalties applied. logits: float32 [N, V] (N <= len(drafted) + 1) at the
    positions after ``tokens`` (the sequence so far, prompt first, as it is held: its output is copied only
    when a penalty needs it) and the drafted tokens: the last row sees every drafted token, each row before
    it one fewer (a verification pass of k drafts has row j after ``drafted[:j]``; a draft step, one row
    after all its drafts so far). Returns the input itself when nothing applies."""
    params = sampler.params
    if not params.processes_logits:
        return logits
    n, vocab = logits.shape
    device = logits.device
    seen_before = len(drafted) - (n - 1)  # drafted tokens the first row sees
    out = logits.clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=device)
        out[:, ids] += torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=device)
    num_output = len(tokens) - len(sampler.prompt_ids) + seen_before  # before the first row
    held = sampler.held_back_ids if num_output < params.min_tokens else []
    if held:
        out[: params.min_tokens - num_output, held] = float("-inf")
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        outputs = list(tokens[len(sampler.prompt_ids):]) + list(drafted[:seen_before])
        counts = _output_counts(outputs, drafted[seen_before:], n, vocab, device)  # [N, V]
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            seen[:, sampler.prompt_tensor(device)] = True
            penalised = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
            out = torch.where(seen, penalised, out)
        if params.frequency_penalty:
            out -= params.frequency_penalty * counts
        if params.presence_penalty:
            out -= params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def _output_counts(output_ids: Seq[int], drafted: Seq[int], n: int, vocab: int, device) -> torch.Tensor:
    """[N, V] float32: row j counts each token in ``output_ids + drafted[:j]``."""
    base = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64), minlength=vocab).to(torch.float32)
    counts = base.to(device).unsqueeze(0).repeat(n, 1)
    for j in range(1, n):
        counts[j:, drafted[j - 1]] += 1
    return counts


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from, given processed logits float32 [N, V]:
    temperature, then min_p, top-k and top-p. Returns probs [N, V]."""
    scaled = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probs [V] with the request's generator. Generators live on the CPU (the same
    seed gives the same tokens on every device), so probabilities computed on a GPU are drawn from there."""
    return int(torch.multinomial(probs.to(generator.device), 1, generator=generator).item())


def token_logprobs(logits: torch.Tensor, tokens: Seq[int], num_top: int) -> list[TokenLogprob]:
    """Raw log-probabilities: logits float32 [N, V] (row j the distribution of ``tokens[j]``, N >= len(tokens))
    -> for each token its log-softmax value, rank and the ``num_top`` most likely tokens."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, ids.unsqueeze(1))  # [n, 1]
    ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
    chosen_list = chosen.squeeze(1).tolist()
    if num_top > 0:
        top_vals, top_ids = torch.topk(logp, min(num_top, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(int(t), float(lp), int(r), top) for t, lp, r, top in zip(tokens, chosen_list, ranks, tops)]


class PromptLogprobs:
    """Collects a prompt's log-probabilities over its prefill chunks: the first token has none (None), token
    q's comes from the logits at position q - 1. Chunks computed again (after a preemption) add nothing."""

    def __init__(self, prompt_ids: Seq[int], num_top: int):
        self.prompt_ids = list(prompt_ids)
        self.num_top = num_top
        self.logprobs: list[TokenLogprob | None] = [None]

    @property
    def done(self) -> bool:
        return len(self.logprobs) >= len(self.prompt_ids)

    def wants(self, start: int) -> bool:
        """Whether a chunk starting at ``start`` needs logits at all its positions."""
        return not self.done and start < len(self.prompt_ids) - 1

    def add(self, logits: torch.Tensor, start: int) -> None:
        """logits float32 [n, V] at positions ``start .. start + n - 1`` (rows past the prompt are ignored)."""
        first = len(self.logprobs) - 1  # the position whose logits score the next unscored token
        end = min(start + logits.shape[0], len(self.prompt_ids) - 1)
        if first < start or first >= end:
            return
        rows = logits[first - start : end - start]
        self.logprobs.extend(token_logprobs(rows, self.prompt_ids[first + 1 : end + 1], self.num_top))
