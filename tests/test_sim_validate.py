"""The measurement-noise interval that benchmarks/sim_validate.py reports beside the 5-point criterion."""

from __future__ import annotations

import pytest

from benchmarks.sim_validate import wilson_interval


def test_wilson_interval_of_a_measured_attainment():
    assert wilson_interval(0.5, 40) == pytest.approx((0.352, 0.648), abs=1e-3)
    lo, hi = wilson_interval(1.0, 40)
    assert hi == 1.0 and lo == pytest.approx(0.912, abs=1e-3)  # all 40 met: the truth may still be 91 %
    assert wilson_interval(0.0, 40)[0] == 0.0
    # four times the requests halve the interval
    assert (lambda a, b: (b[1] - b[0]) / (a[1] - a[0]))(wilson_interval(0.5, 40), wilson_interval(0.5, 160)) \
        == pytest.approx(0.5, abs=0.02)
    assert wilson_interval(0.3, 0) == (0.0, 1.0)
