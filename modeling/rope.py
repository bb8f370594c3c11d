"""Rotary position embeddings (RoPE), with the ``linear`` and ``llama3`` frequency scalings.

Layout follows Hugging Face Llama (``rotate_half``): the two halves of each head's dimensions are the
real and imaginary parts, not interleaved pairs.
"""

from __future__ import annotations

import math

import torch

from modeling.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies, float32 [head_dim // 2] on the CPU, after scaling. (Computed on the CPU
    whatever the default device: the same values everywhere, and no meta-device arithmetic, whose Python
    decompositions import torch._dynamo on first use.)"""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: leave high frequencies, divide low frequencies by factor, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for arbitrary (possibly re-indexed) positions."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # on the default device (that of a ``with torch.device(...)`` block around the model's construction)
        self.register_buffer("inv_freq", inverse_frequencies(config).to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int [...]; returns (cos, sin), each [..., head_dim] in ``dtype``."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, H, D]; cos/sin: [..., T, D] (broadcast over heads)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
