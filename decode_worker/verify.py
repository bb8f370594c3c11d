"""The speculative verification rule (lossless), in one place.

Terms (as in vLLM's rejection sampler):
* accepted tokens: the longest prefix of the k draft tokens that the target keeps;
* recovered token: at the first rejection, a replacement drawn from the residual distribution
  ``norm(max(0, p - q))`` (greedy: the target's argmax);
* bonus token: when all k drafts are accepted, one more token drawn from the target at position k.
Every verification step yields ``accepted + 1`` tokens.

Sampling: draft token d_i ~ q_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); the output is
then distributed exactly as the target p (Leviathan et al., 2023; Chen et al., 2023).
Greedy: d_i is accepted iff it equals argmax p_i; the output equals plain greedy decoding token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """Outcome for one sequence: ``tokens`` = accepted drafts + one recovered or bonus token."""

    num_accepted: int
    tokens: list[int]


def verify_greedy(draft: list[int], target_argmax: list[int]) -> Verdict:
    """draft: k tokens; target_argmax: k + 1 argmax ids of the target at the k + 1 verified positions."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target_argmax[accepted]:
        accepted += 1
    # target_argmax[accepted] is the recovered token (mismatch) or the bonus token (all accepted)
    return Verdict(accepted, draft[:accepted] + [target_argmax[accepted]])


def verify_sampled(
    draft: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> Verdict:
    """Rejection sampling. draft_probs: q [k, V]; target_probs: p [k + 1, V]; both already processed
    by the request's temperature / top-k / top-p (the distributions actually sampled from)."""
    k = len(draft)
    # draws happen where the request's generator lives (the CPU), whatever device computed the probabilities
    draft_probs, target_probs = draft_probs.to(generator.device), target_probs.to(generator.device)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64) if k else None
    for i, tok in enumerate(draft):
        p, q = float(target_probs[i, tok]), float(draft_probs[i, tok])
        # accept with probability min(1, p / q); q > 0 since tok was drawn from q
        if q > 0 and uniforms[i].item() * q < p:
            continue
        residual = torch.clamp(target_probs[i] - draft_probs[i], min=0.0)
        total = residual.sum()
        # total == 0 only if p == q, where rejection has probability 0; guard against rounding anyway
        dist = residual / total if total > 0 else target_probs[i]
        recovered = int(torch.multinomial(dist, 1, generator=generator).item())
        return Verdict(i, draft[:i] + [recovered])
    bonus = int(torch.multinomial(target_probs[k], 1, generator=generator).item())
    return Verdict(k, list(draft) + [bonus])
