"""Token selection (sampling parameters and their validation: ``modeling/params.py``).

``target_probs`` turns logits into the exact distribution a request samples from (temperature, top-k,
top-p applied); speculative verification uses the same function so that it preserves that distribution.
Randomness comes from one ``torch.Generator`` per request, seeded from ``seed`` when given: the same
seed gives the same output whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modeling.params import SamplingParams

def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator; an unseeded request gets a fresh random seed."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from. logits: float32 [N, V] -> probs [N, V]."""
    scaled = logits / params.temperature
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


@dataclass
class RequestSampler:
    """Per-request sampling state: parameters plus the generator that makes it reproducible."""

    params: SamplingParams
    generator: torch.Generator = field(repr=False, default=None)

    def __post_init__(self) -> None:
        if self.generator is None:
            self.generator = make_generator(self.params.seed)

    def choose(self, logits: torch.Tensor) -> int:
        """logits: float32 [V] -> next token id."""
        if self.params.greedy:
            return int(torch.argmax(logits).item())
        return sample_from(target_probs(logits.unsqueeze(0), self.params)[0], self.generator)
