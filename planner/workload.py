"""Workloads shared by the SLO sweep (real requests) and the simulator (simulated requests): request
length distributions and arrival processes. Pure Python (no torch), seeded, reproducible.

A workload is a list of :class:`RequestSpec` (arrival offset, prompt length, output length). Output
lengths are exact (requests are sent with ``ignore_eos``) so a real run and a simulation of the same
trace do the same work.

Built-in shapes (``WORKLOADS``), scaled to what the bundled 15M model and a 2-core CPU can serve; the
shapes follow the public datasets DistServe evaluates on:

* ``chat``: ShareGPT-like, short prompts and medium answers, both log-normal with long tails;
* ``long_doc``: LongBench-like summarisation, long prompts (1K-4K tokens) and short outputs;
* ``mixed``: half ``chat``, half ``long_doc`` (request sizes spread widely, as in Mélange's mixed dataset);
* ``long_gen``: MagicDec's regime, 16K-32K-token prompts and 256-1024-token outputs (GPU-scale plans).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass


class WorkloadError(ValueError):
    pass


@dataclass(frozen=True)
class LengthDist:
    """Log-normal lengths with the given median and sigma (of log), clipped to [lo, hi]."""

    median: int
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return int(min(self.hi, max(self.lo, round(self.median * math.exp(rng.gauss(0.0, self.sigma))))))

    def validate(self, name: str) -> None:
        if not (1 <= self.lo <= self.median <= self.hi):
            raise WorkloadError(f"{name}: need 1 <= lo <= median <= hi, got lo={self.lo} median={self.median} hi={self.hi}")
        if not (0.0 <= self.sigma <= 3.0):
            raise WorkloadError(f"{name}.sigma: must be in [0, 3], got {self.sigma}")


@dataclass(frozen=True)
class WorkloadShape:
    """Prompt and output length distributions, or a mixture of shapes (``mix``: (weight, shape) pairs, one
    component drawn per request)."""

    name: str
    prompt: LengthDist | None = None
    output: LengthDist | None = None
    mix: tuple[tuple[float, "WorkloadShape"], ...] = ()

    def validate(self) -> None:
        if self.mix:
            if any(not w > 0 for w, _ in self.mix):
                raise WorkloadError(f"{self.name}.mix: weights must be > 0")
            for _, comp in self.mix:
                comp.validate()
            return
        if self.prompt is None or self.output is None:
            raise WorkloadError(f"{self.name}: needs prompt and output distributions, or a mix")
        self.prompt.validate(f"{self.name}.prompt")
        self.output.validate(f"{self.name}.output")

    def longest(self) -> int:
        """The most tokens (prompt + output) one request can have."""
        if self.mix:
            return max(c.longest() for _, c in self.mix)
        return self.prompt.hi + self.output.hi

    def sample(self, rng: random.Random) -> tuple[int, int]:
        """One request's (prompt, output) lengths."""
        if self.mix:
            comp = rng.choices([c for _, c in self.mix], weights=[w for w, _ in self.mix])[0]
            return comp.sample(rng)
        return self.prompt.sample(rng), self.output.sample(rng)


_CHAT = WorkloadShape("chat", LengthDist(median=256, sigma=0.8, lo=16, hi=2048),
                      LengthDist(median=96, sigma=0.7, lo=8, hi=384))
# prompts up to the bundled model's trained context (4K)
_LONG_DOC = WorkloadShape("long_doc", LengthDist(median=2048, sigma=0.4, lo=1024, hi=4096),
                          LengthDist(median=48, sigma=0.4, lo=16, hi=128))
WORKLOADS: dict[str, WorkloadShape] = {
    "chat": _CHAT,
    "long_doc": _LONG_DOC,
    "mixed": WorkloadShape("mixed", mix=((0.5, _CHAT), (0.5, _LONG_DOC))),
    "long_gen": WorkloadShape("long_gen", LengthDist(median=22000, sigma=0.2, lo=16384, hi=32768),
                              LengthDist(median=512, sigma=0.4, lo=256, hi=1024)),
}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a trace: arrival offset from the trace start (s), prompt and output lengths, and the
    prompt tokens whose KV a prefill instance already holds (a prefix-cache hit: not computed again)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0


def workload_shape(name: str) -> WorkloadShape:
    if name not in WORKLOADS:
        raise WorkloadError(f"workload: unknown {name!r}; choose one of {sorted(WORKLOADS)} or pass a trace file")
    return WORKLOADS[name]


def arrival_times(rate: float, n: int, seed: int, cv: float = 1.0) -> list[float]:
    """``n`` arrival offsets of a renewal process with mean rate ``rate`` (req/s): Poisson when
    ``cv`` == 1, gamma-distributed gaps with coefficient of variation ``cv`` otherwise."""
    if rate <= 0:
        raise WorkloadError(f"rate: must be > 0 requests/s, got {rate}")
    if cv <= 0:
        raise WorkloadError(f"cv: must be > 0, got {cv}")
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(shape, 1.0 / (shape * rate))
    return out


def make_trace(shape: WorkloadShape, rate: float, n: int, seed: int = 0, cv: float = 1.0) -> list[RequestSpec]:
    """``n`` requests of ``shape`` arriving at ``rate`` req/s. The lengths depend only on (shape, seed),
    not on the rate, so sweeps over rates send the same requests at different speeds."""
    shape.validate()
    if n < 1:
        raise WorkloadError(f"num_requests: must be >= 1, got {n}")
    rng = random.Random(seed)
    lengths = [shape.sample(rng) for _ in range(n)]
    return [RequestSpec(t, p, o) for t, (p, o) in zip(arrival_times(rate, n, seed + 1, cv), lengths)]


def scale_trace(trace: list[RequestSpec], rate: float) -> list[RequestSpec]:
    """The same requests replayed at mean rate ``rate`` (arrival gaps rescaled)."""
    if not trace:
        return []
    span = trace[-1].arrival_s
    current = (len(trace) - 1) / span if span > 0 else rate
    return [RequestSpec(r.arrival_s * current / rate, r.prompt_tokens, r.output_tokens, r.cached_tokens) for r in trace]


def save_trace(trace: list[RequestSpec], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            f.write(json.dumps(asdict(r)) + "\n")


def load_trace(path: str) -> list[RequestSpec]:
    """A JSON-lines trace: one object per line with arrival_s, prompt_tokens, output_tokens (and optionally
    cached_tokens)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                r = RequestSpec(float(d["arrival_s"]), int(d["prompt_tokens"]), int(d["output_tokens"]),
                                int(d.get("cached_tokens", 0)))
            except (KeyError, ValueError, TypeError) as e:
                raise WorkloadError(f"{path}:{i}: need arrival_s, prompt_tokens, output_tokens ({e})") from None
            if r.prompt_tokens < 1 or r.output_tokens < 1 or r.arrival_s < 0:
                raise WorkloadError(f"{path}:{i}: lengths must be >= 1 and arrival_s >= 0")
            if not 0 <= r.cached_tokens < r.prompt_tokens:
                raise WorkloadError(f"{path}:{i}: cached_tokens must be in [0, prompt_tokens), got {r.cached_tokens}")
            out.append(r)
    if not out:
        raise WorkloadError(f"{path}: empty trace")
    return sorted(out, key=lambda r: r.arrival_s)
