"""The eval script's context-gain measurement: which tokens it scores, with how much context, and its verdict."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import eval_default_model as ev  # noqa: E402
from modeling.checkpoint import load_model  # noqa: E402


def test_windows_hold_the_segment_fixed_and_vary_only_the_context(llama_dir, monkeypatch):
    model = load_model(llama_dir, dtype="float32").model
    seen = []
    real = ev.token_losses

    def spy(m, window):
        seen.append(window.clone())
        return real(m, window)

    monkeypatch.setattr(ev, "token_losses", spy)
    rng = np.random.default_rng(0)
    files = [rng.integers(1, 60, size=n).astype(np.int32) for n in (70, 40, 20)]  # the last is too short (needs 16 + 4 + 1)
    gain = ev.context_gain(model, files, [4, 8, 16], segment=4, per_file=3, resamples=200)

    assert gain.files == 2 and len(gain.per_file) == 2
    # file 0: segment ends 21, 25, ..., 69 -> 13 candidates, 3 kept; file 1: ends 21 .. 37 -> 5, 3 kept
    assert gain.segments == 6 and len(seen) == 6 * 3
    for i in range(0, len(seen), 3):
        tails = {tuple(w[-4:].tolist()) for w in seen[i : i + 3]}
        assert len(tails) == 1  # the same 4 scored tokens for every context
        assert [w.numel() for w in seen[i : i + 3]] == [4 + 4 + 1, 8 + 4 + 1, 16 + 4 + 1]
    assert np.allclose(gain.drop, np.array(gain.loss[:-1]) - np.array(gain.loss[1:]))
    assert all(lo <= hi for lo, hi in gain.drop_ci95)


def test_verdict_needs_every_drop_above_zero_up_to_the_limit():
    def gain(cis):
        n = len(cis) + 1
        return ev.ContextGain(contexts=[256 * 2**i for i in range(n)], segment=8, files=3, segments=9,
                              loss=[0.0] * n, drop=[0.0] * (n - 1), drop_ci95=cis, per_file=[])

    # contexts 256, 512, 1024, 2048, 4096, 8192
    good = [(0.02, 0.05), (0.01, 0.03), (0.004, 0.01), (0.001, 0.004)]
    assert ev.falls_to(gain(good), 4096)
    assert not ev.falls_to(gain(good[:3] + [(-0.001, 0.004)]), 4096)  # flat 2K -> 4K
    assert ev.falls_to(gain(good + [(-0.01, 0.0)]), 4096)  # what happens past the limit does not count
    assert not ev.falls_to(gain([]), 4096)


def test_token_losses_match_a_direct_cross_entropy(llama_dir):
    model = load_model(llama_dir, dtype="float32").model
    ids = torch.randint(1, 60, (12,))
    with torch.no_grad():
        logits = model.forward_dense(ids[None, :-1])[0].float()
    direct = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
    assert torch.allclose(ev.token_losses(model, ids), direct, rtol=0.03)  # bf16 autocast
