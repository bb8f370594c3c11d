"""What the router and the fronts exchange (no torch, no Ray): the instances as the router sees them, the
items a request's stream yields (``Delta`` ..., then one ``Final``), and the router's error."""

from __future__ import annotations

from dataclasses import dataclass, field

from modeling.prefix_cache import CachedPrompt


class RouterError(Exception):
    """A request the router cannot serve; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Instance:
    """A worker actor as the router sees it (one object per instance: compared and hashed by identity)."""

    name: str
    role: str  # "prefill" | "decode" | "colocated"
    handle: object
    alive: bool = True
    generation: int = 0  # bumped when the instance restarts or changes role (new KV channels, counters from 0)
    restarts: int = 0  # times its ranks were replaced after a fault
    assigned: set = field(default_factory=set)  # request ids currently placed here
    migrating_in: set = field(default_factory=set)  # request ids migrating here, not yet committed
    draining: bool = False  # takes no new requests (``Router.drain``)
    room: bool = True  # decode: its last hold succeeded, or a request has left it since (new requests go to it
    # and to a prefill instance at once)
    load: object = None  # decode: its latest ``PoolLoad`` report (None until the first arrives)
    placed: dict = field(default_factory=dict)  # decode: request id -> blocks, placed since that report


@dataclass(frozen=True)
class Delta:
    """Streamed to the client: new token ids and text of sequence ``index`` (0 unless the request asked for
    several); their log-probabilities when the request asked for them, and on the request's first delta the
    prompt's (``prompt_logprobs``). ``finish_reason``: this sequence ended here (a request of several
    sequences; the Final closes a request of one)."""

    token_ids: list[int]
    text: str
    logprobs: tuple = ()
    prompt_logprobs: tuple | None = None
    index: int = 0
    finish_reason: str | None = None


@dataclass(frozen=True)
class Final:
    """The last message of a request."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    mean_tpot_s: float
    draft_tokens: int
    accepted_tokens: int
    finished_choices: frozenset = frozenset()  # sequences whose Delta carried their finish reason
    cached: CachedPrompt = CachedPrompt()  # what was found of the prompt rather than computed
