"""scripts/train_default_model.py's schedule and data sampling (the parts that decide the shipped weights
beyond the model code): one warmup + cosine over both phases, phase boundaries, windows inside files."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from train_default_model import TrainConfig, document_spans, lr_at, phase_of, sample_file_windows  # noqa: E402


def test_one_warmup_and_one_cosine_over_both_phases():
    cfg = TrainConfig()
    lrs = [lr_at(s, cfg) for s in range(cfg.total_steps)]
    assert lrs[0] == pytest.approx(cfg.lr / cfg.warmup_steps)
    assert max(lrs) == pytest.approx(cfg.lr) and lrs[cfg.warmup_steps - 1] == pytest.approx(cfg.lr)
    assert lrs[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio)  # the floor is reached at the last step
    after = lrs[cfg.warmup_steps - 1:]
    assert all(b <= a for a, b in zip(after, after[1:]))  # no re-warm at the phase boundary
    mid = cfg.warmup_steps + (cfg.total_steps - 1 - cfg.warmup_steps) / 2
    assert lr_at(math.ceil(mid), cfg) <= cfg.lr * (1 + cfg.min_lr_ratio) / 2 <= lr_at(math.floor(mid), cfg)


def test_phases_switch_from_short_stream_windows_to_long_ones():
    cfg = TrainConfig()
    assert phase_of(cfg.short_steps - 1, cfg) == (cfg.short_seq_len, cfg.short_batch, cfg.short_batch)
    assert phase_of(cfg.short_steps, cfg) == (cfg.long_seq_len, cfg.long_batch, cfg.long_micro_batch)
    assert cfg.total_steps == cfg.short_steps + cfg.long_steps


def test_file_windows_lie_inside_one_long_document_and_are_seeded_by_step():
    eos = 0
    rng = np.random.default_rng(0)
    lengths = [30, 200, 5, 120]
    tokens = np.concatenate([np.append(rng.integers(1, 50, n), eos) for n in lengths]).astype(np.uint16)
    spans = document_spans(tokens, eos)
    assert spans[1].tolist() == lengths
    for step in range(50):
        rows = sample_file_windows(tokens, spans, 4, 64, 0.25, seed=1, step=step)
        assert rows.shape == (4, 65) and not (rows == eos).any()  # never crosses a document boundary
        for row in rows.numpy():
            doc = next(d for d, (s, n) in enumerate(zip(*spans)) if any(
                (tokens[s + o: s + o + 65] == row).all() for o in range(n - 64)))
            assert lengths[doc] >= 65  # only documents long enough are drawn
        again = sample_file_windows(tokens, spans, 4, 64, 0.25, seed=1, step=step)
        assert (again == rows).all()
    with pytest.raises(ValueError, match="long_seq_len"):
        sample_file_windows(tokens, spans, 1, 500, 0.25, seed=1, step=0)
