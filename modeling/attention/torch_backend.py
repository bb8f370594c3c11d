"""Pure-torch paged attention (CPU and CUDA): the correctness oracle and CI's path.

For each sequence, attention is split into partial results that are merged with their log-sum-exp:

* prefix segments: runs of physically contiguous cache blocks, read as zero-copy views
  (no per-step rebuild of the cache), visible to every new token (no mask);
* the self segment: the step's own new keys/values, causal among the new tokens.

On a layer with a sliding window ``W`` (new token at position ``p`` sees keys ``p - W + 1 .. p``) the
prefix segments keep only the keys every new token sees; the few prefix keys that only some new tokens
see (at most ``q_len - 1``: the window's lower edge moves by one per new token) form one gathered
segment with a per-token mask, and the self segment is also masked by the window when the step has more
than ``W`` new tokens. A decode step (one new token) needs no mask at all.

Each KV head is read once for all of its query heads and query tokens: the ``G`` query heads of a KV
head and the ``Q`` new tokens are folded into one [G * Q] row block against that head's keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from modeling.attention.metadata import AttentionMetadata, physical_runs

# Prefix runs shorter than this are gathered into one tensor (a small copy) rather than attended to
# one by one: many tiny segments cost more in per-call overhead than the copy.
_SHORT_RUN_TOKENS = 256
# Bound on the float32 score matrix of the math path: [heads, rows, keys] elements per chunk.
_MATH_CHUNK_ELEMS = 1 << 26

_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class TorchAttentionBackend:
    """Reference backend. ``use_fused_cpu_kernel`` picks torch's fused CPU flash kernel for the
    partial attentions (same math, faster); the plain float32 math path is used otherwise."""

    name = "torch"

    def __init__(self, use_fused_cpu_kernel: bool = True):
        self.use_fused_cpu_kernel = use_fused_cpu_kernel

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (already written to the cache);
        k_cache, v_cache: [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D]. ``sliding_window``: the
        layer's window (None: full attention)."""
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, hkv, d)
        v_flat = v_cache.view(-1, hkv, d)
        out = torch.empty_like(q)
        for b in range(meta.num_seqs):
            s, e = meta.query_start[b], meta.query_start[b + 1]
            if s == e:
                continue
            out[s:e] = self._attend_sequence(q[s:e], k[s:e], v[s:e], k_flat, v_flat, meta, b, sliding_window)
        return out

    def _attend_sequence(self, q, k_new, v_new, k_flat, v_flat, meta: AttentionMetadata, b: int,
                         window: int | None) -> torch.Tensor:
        # q: [Q, Hq, D]; k_new, v_new: [Q, Hkv, D]; k_flat, v_flat: [slots, Hkv, D]
        n_q, hq, d = q.shape
        hkv = k_new.shape[1]
        g = hq // hkv
        scale = 1.0 / math.sqrt(d)
        partials: list[tuple[torch.Tensor, torch.Tensor]] = []  # (out [Q, Hq, D] f32, lse [Q, Hq] f32)

        segments = self._prefix_segments(k_flat, v_flat, meta.block_tables[b], meta.block_size,
                                         meta.shared_prefix_ranges(b, window))
        if segments:
            # fold: [Q, Hkv*G, D] -> [Hkv, G*Q, D]  (row index = g * Q + qi)
            q_fold = q.view(n_q, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n_q, d)
            for k_seg, v_seg in segments:
                # k_seg: [n, Hkv, D] -> [Hkv, n, D] (a strided view, no copy)
                o, lse = self._partial(q_fold, k_seg.transpose(0, 1), v_seg.transpose(0, 1), scale, causal=False)
                o = o.view(hkv, g, n_q, d).permute(2, 0, 1, 3).reshape(n_q, hq, d)
                lse = lse.view(hkv, g, n_q).permute(2, 0, 1).reshape(n_q, hq)
                partials.append((o, lse))

        q_h = q.transpose(0, 1)  # [Hq, Q, D]
        if window is not None:
            ctx = meta.context_len(b)
            q_pos = torch.arange(ctx, ctx + n_q, device=q.device)
            # window edge: prefix keys only some new tokens see, gathered, masked per token
            edge = meta.window_edge_ranges(b, window)
            if edge:
                key_pos = torch.cat([torch.arange(start, end) for start, end in edge]).to(q.device)
                slots = torch.tensor(_all_slots(meta.block_tables[b], meta.block_size, edge), device=q.device)
                k_e = k_flat.index_select(0, slots).transpose(0, 1).repeat_interleave(g, dim=0)
                v_e = v_flat.index_select(0, slots).transpose(0, 1).repeat_interleave(g, dim=0)
                o, lse = _math_partial(q_h, k_e, v_e, scale, q_pos, key_pos, window)
                partials.append((o.transpose(0, 1), lse.transpose(0, 1)))

        # self segment: new tokens among themselves, causal. [Hq, Q, D] with KV heads repeated.
        k_h = k_new.transpose(0, 1).repeat_interleave(g, dim=0)
        v_h = v_new.transpose(0, 1).repeat_interleave(g, dim=0)
        if window is not None and n_q > window:
            o, lse = _math_partial(q_h, k_h, v_h, scale, q_pos, q_pos, window)
        else:
            o, lse = self._partial(q_h, k_h, v_h, scale, causal=True)
        partials.append((o.transpose(0, 1), lse.transpose(0, 1)))
        return _merge(partials).to(q.dtype)

    @staticmethod
    def _prefix_segments(k_flat, v_flat, table: list[int], block_size: int, ranges: list[tuple[int, int]]):
        """The prefix KV at positions ``ranges`` as a list of ([n, Hkv, D] keys, values) slabs."""
        runs: list[tuple[int, int]] = []
        for start, end in ranges:
            runs.extend(physical_runs(table, block_size, start, end))
        long_runs = [r for r in runs if r[1] >= _SHORT_RUN_TOKENS]
        short_runs = [r for r in runs if r[1] < _SHORT_RUN_TOKENS]
        segments = [(k_flat[s : s + n], v_flat[s : s + n]) for s, n in long_runs]
        if len(short_runs) == 1:
            s, n = short_runs[0]
            segments.append((k_flat[s : s + n], v_flat[s : s + n]))
        elif short_runs:
            idx = torch.cat([torch.arange(s, s + n) for s, n in short_runs]).to(k_flat.device)
            segments.append((k_flat.index_select(0, idx), v_flat.index_select(0, idx)))
        return segments

    def _partial(self, q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [H, M, D]; k, v: [H, N, D] -> (out [H, M, D] float32, lse [H, M] float32)."""
        if self.use_fused_cpu_kernel and _cpu_flash is not None and q.device.type == "cpu":
            out, lse = _cpu_flash(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, scale=scale)
            return out[0].float(), lse[0]
        if not causal:
            return _math_partial(q, k, v, scale)
        pos = torch.arange(q.shape[1], device=q.device)
        return _math_partial(q, k, v, scale, pos, pos)


def _math_partial(q, k, v, scale: float, q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float32 attention with log-sum-exp, chunked over query rows to bound memory.

    q: [H, M, D]; k, v: [H, N, D]. Without positions every row sees every key; with ``q_pos`` [M] and
    ``k_pos`` [N], row i sees key j iff k_pos[j] <= q_pos[i] (and k_pos[j] > q_pos[i] - window when a
    window is given). A row that sees no key gets output 0 and log-sum-exp -inf (weight 0 in a merge)."""
    h, m, _ = q.shape
    n = k.shape[1]
    kf, vf = k.float(), v.float()
    rows = max(1, _MATH_CHUNK_ELEMS // max(1, h * n))
    outs, lses = [], []
    for r0 in range(0, m, rows):
        qc = q[:, r0 : r0 + rows].float()
        scores = torch.matmul(qc, kf.transpose(1, 2)) * scale  # [H, rows, N]
        if q_pos is not None:
            offset = q_pos[r0 : r0 + qc.shape[1]].unsqueeze(1) - k_pos.unsqueeze(0)  # [rows, N]
            hidden = offset < 0
            if window is not None:
                hidden |= offset >= window
            scores = scores.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, rows]
        safe = lse.masked_fill(torch.isinf(lse), 0.0)  # rows with no visible key: exp(-inf - 0) = 0
        outs.append(torch.matmul(torch.exp(scores - safe.unsqueeze(-1)), vf))
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _merge(partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine partial attentions over disjoint key sets: softmax-weighted by their log-sum-exps."""
    if len(partials) == 1:
        return partials[0][0]
    lses = torch.stack([lse for _, lse in partials])  # [P, Q, H]
    total = torch.logsumexp(lses, dim=0)  # [Q, H]
    out = torch.zeros_like(partials[0][0])
    for (o, lse) in partials:
        out += torch.exp(lse - total).unsqueeze(-1) * o
    return out


def dense_reference_attention(q, k_cache, v_cache, meta: AttentionMetadata,
                              sliding_window: int | None = None) -> torch.Tensor:
    """Slowest, simplest oracle for tests: gather each sequence's cache and mask by the visibility rule."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    out = torch.empty_like(q)
    for b in range(meta.num_seqs):
        s, e = meta.query_start[b], meta.query_start[b + 1]
        n = meta.seq_lens[b]
        slots = torch.tensor(_all_slots(meta.block_tables[b], meta.block_size, [(0, n)]), device=q.device)
        kb = k_flat[slots].float().transpose(0, 1)  # [Hkv, n, D]
        vb = v_flat[slots].float().transpose(0, 1)
        qb = q[s:e].float().transpose(0, 1)  # [Hq, Q, D]
        pos = torch.arange(meta.context_len(b), n, device=q.device).unsqueeze(1)  # [Q, 1]
        j = torch.arange(n, device=q.device).unsqueeze(0)
        visible = j <= pos
        if meta.window_starts is not None:
            visible &= (j < meta.sink_len) | (j >= meta.window_starts[b])
        if sliding_window is not None:
            visible &= j > pos - sliding_window
        o = F.scaled_dot_product_attention(qb.unsqueeze(0), kb.unsqueeze(0), vb.unsqueeze(0),
                                           attn_mask=visible, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1).to(q.dtype)
    return out


def _all_slots(table: list[int], block_size: int, ranges: list[tuple[int, int]]) -> list[int]:
    """Cache slots of the positions in [start, end) ``ranges``, in order."""
    return [table[p // block_size] * block_size + p % block_size for s, e in ranges for p in range(s, e)]
