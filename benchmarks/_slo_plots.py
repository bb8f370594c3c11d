"""DistServe-style figures of an SLO sweep (matplotlib, PNG, no display needed).

* :func:`plot_attainment_vs_rate`: SLO attainment (both SLOs, TTFT only, TPOT only) against the request
  rate, with the target attainment as a horizontal line;
* :func:`plot_attainment_vs_scale`: the same three shares at one rate against a common scale factor of
  both SLOs (tighter to the left);
* :func:`plot_compare`: the "both" curve of several systems on one figure.
"""

from __future__ import annotations

CURVES = (("both", "both SLOs", "-", "o"), ("ttft_only", "TTFT SLO only", "--", "s"), ("tpot_only", "TPOT SLO only", ":", "^"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _emphasis(key: str) -> dict:
    """'both' is drawn on top and thicker (it often coincides with one of the single-SLO curves)."""
    return {"zorder": 3, "linewidth": 2.2} if key == "both" else {"zorder": 2, "linewidth": 1.3, "markersize": 5}


def _finish(plt, fig, ax, target: float, title: str, xlabel: str, path: str) -> None:
    ax.axhline(100 * target, color="grey", linewidth=1, linestyle="-.", label=f"{target:.0%} target")
    ax.set_ylim(-3, 103)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_attainment_vs_rate(path: str, rates: list[float], attainment: dict[str, list[float]], target: float,
                            title: str, xlabel: str = "request rate (req/s)") -> None:
    """``attainment``: 'both' / 'ttft_only' / 'tpot_only' -> share (0..1) per rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for key, label, style, marker in CURVES:
        ax.plot(rates, [100 * a for a in attainment[key]], style, marker=marker, label=label, **_emphasis(key))
    _finish(plt, fig, ax, target, title, xlabel, path)


def plot_attainment_vs_scale(path: str, scales: list[float], attainment: dict[str, list[float]], target: float,
                             title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for key, label, style, marker in CURVES:
        ax.plot(scales, [100 * a for a in attainment[key]], style, marker=marker, label=label, **_emphasis(key))
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    _finish(plt, fig, ax, target, title, "SLO scale (x the given TTFT and TPOT SLOs)", path)


def plot_compare(path: str, systems: list[dict], target: float, title: str, xlabel: str) -> None:
    """``systems``: dicts with 'label', 'x' (rates or per-core rates), 'both' (shares) and optionally 'color'."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    markers = "osD^v<>px*"
    for i, s in enumerate(systems):
        ax.plot(s["x"], [100 * a for a in s["both"]], "-", marker=markers[i % len(markers)], label=s["label"],
                color=s.get("color"))
    _finish(plt, fig, ax, target, title, xlabel, path)
