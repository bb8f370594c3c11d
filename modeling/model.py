"""Llama-family decoder (Llama 2/3/3.x, Mistral, Qwen2) in plain torch.

The model works on a flat list of tokens (``T`` = all new tokens of all sequences in a step) and leaves
attention to an :class:`AttentionContext`, which decides where keys and values come from: the paged KV
cache when serving (:mod:`modeling.attention`), or a dense causal batch when training
(:class:`DenseCausalContext`). Each layer passes its sliding window (``ModelConfig.layer_window``; None
for full attention) to the context, which applies it: a query at position ``p`` then sees keys
``p - W + 1 .. p`` only. Parameter names match Hugging Face checkpoints exactly, so
``state_dict()`` loads from and saves to HF format without renaming.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from modeling.config import ModelConfig
from modeling.rope import RotaryEmbedding, apply_rotary


class AttentionContext(Protocol):
    """Where a layer's attention reads its keys/values from. One instance per forward pass."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens (RoPE applied). Returns [T, Hq, D].
        ``sliding_window`` W: a query at position p sees keys p - W + 1 .. p (None: all keys up to p)."""
        ...


class DenseCausalContext:
    """Plain causal attention over ``batch`` rows of ``seq_len`` tokens each (training, evaluation)."""

    def __init__(self, batch: int, seq_len: int):
        self.batch = batch
        self.seq_len = seq_len

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        b, s = self.batch, self.seq_len
        # [T, H, D] -> [B, H, S, D]
        qb, kb, vb = (t.view(b, s, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        if sliding_window is None or sliding_window >= s:
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        else:
            i = torch.arange(s, device=q.device)
            offset = i.unsqueeze(1) - i.unsqueeze(0)  # [S, S] query position - key position
            visible = (offset >= 0) & (offset < sliding_window)
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * s, q.shape[1], q.shape[2])


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 as in the reference implementation."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class SelfAttention(nn.Module):
    """Grouped-query attention projections around an AttentionContext."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        d = config.head_dim
        self.layer = layer
        self.sliding_window = config.layer_window(layer)  # None: full attention
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, config.hidden_size, bias=config.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = ctx.attend(self.layer, q, k, v, self.sliding_window)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = SelfAttention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Embeddings, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # nn.Embedding's own init, drawn here unless on the meta device (the loader's skeleton, which the checkpoint
        # fills): torch's meta normal_ is a Python decomposition whose first call imports torch._dynamo (seconds
        # of every worker's start-up)
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """A Llama-family causal language model.

    ``forward`` maps flat token ids [T] at ``positions`` [T] to final hidden states [T, hidden];
    ``logits`` projects selected hidden states to float32 vocabulary logits.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training/evaluation path: input_ids [B, S] -> float32 logits [B, S, vocab], causal."""
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).repeat(b)
        hidden = self.forward(input_ids.reshape(-1), positions, DenseCausalContext(b, s))
        return self.logits(hidden).view(b, s, -1)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict in HF layout; a tied lm_head is omitted, as HF saves it."""
        state = {k: v for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state
