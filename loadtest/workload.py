"""Workload: a deterministic stream of synthetic chat/completion sessions for load tests.

Session i depends only on (config, i): its own random.Random is seeded with f"{seed}/{i}", so
any process (the runner, each locust process, a test) rebuilds the same session i. Modes:
- single turn: one user message of `input_tokens` length;
- shared prefix: every session starts with the same system prompt of `shared_prefix_tokens`
  tokens (exercises the server's prefix cache);
- multi-turn: `num_turns` user messages; the client appends the server's replies between them.
No locust import here: pytest imports this.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields

from loadtest.text import TextSource

ENDPOINTS = ("chat_stream", "chat", "completions_stream", "completions")


# ---- length distributions (tokens), every one clipped to [min_tokens, max_tokens] -----------


@dataclass(frozen=True, slots=True)
class Fixed:
    value: int

    def sample(self, rng: random.Random) -> int:
        return self.value


@dataclass(frozen=True, slots=True)
class Uniform:
    low: int
    high: int  # inclusive

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Long-tailed: ln(n) ~ Normal(ln(median), sigma), clipped."""

    median: float
    sigma: float
    min_tokens: int = 1
    max_tokens: int = 4096

    def sample(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.max_tokens, max(self.min_tokens, value))


@dataclass(frozen=True, slots=True)
class Pareto:
    """Heavy-tailed: P(n > x) = (scale / x) ** alpha for x ≥ scale, clipped."""

    scale: float
    alpha: float
    min_tokens: int = 1
    max_tokens: int = 4096

    def sample(self, rng: random.Random) -> int:
        value = round(self.scale * rng.paretovariate(self.alpha))
        return min(self.max_tokens, max(self.min_tokens, value))


LengthDist = Fixed | Uniform | LogNormal | Pareto

_DIST_KEYS: dict[str, tuple[type, dict[str, str]]] = {
    "fixed": (Fixed, {"n": "value"}),
    "uniform": (Uniform, {"low": "low", "high": "high"}),
    "lognormal": (
        LogNormal,
        {"median": "median", "sigma": "sigma", "min": "min_tokens", "max": "max_tokens"},
    ),
    "pareto": (
        Pareto,
        {"scale": "scale", "alpha": "alpha", "min": "min_tokens", "max": "max_tokens"},
    ),
}


def parse_length(spec: str) -> LengthDist:
    """'128' | 'fixed,n=128' | 'uniform,low=32,high=256' | 'lognormal,median=128,sigma=0.8,max=1024'
    | 'pareto,scale=32,alpha=1.5,max=2048'."""
    spec = spec.strip()
    if spec.isdigit():
        return _checked(Fixed(int(spec)))
    kind, *pairs = [part.strip() for part in spec.split(",")]
    if kind not in _DIST_KEYS:
        raise ValueError(f"unknown length distribution {kind!r}; use one of {list(_DIST_KEYS)}")
    cls, keys = _DIST_KEYS[kind]
    kwargs: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in keys:
            raise ValueError(f"{kind}: expected one of {list(keys)} as key=value, got {pair!r}")
        kwargs[keys[key]] = float(value)
    types = {f.name: f.type for f in fields(cls)}
    try:
        dist = cls(**{k: int(v) if types[k] == "int" else v for k, v in kwargs.items()})
    except TypeError as exc:
        raise ValueError(f"{kind}: missing parameter ({exc})") from None
    return _checked(dist)


def _checked(dist: LengthDist) -> LengthDist:
    bad = (
        (isinstance(dist, Fixed) and dist.value < 1)
        or (isinstance(dist, Uniform) and not 1 <= dist.low <= dist.high)
        or (isinstance(dist, LogNormal) and (dist.median <= 0 or dist.sigma < 0))
        or (isinstance(dist, Pareto) and (dist.scale <= 0 or dist.alpha <= 0))
        or (isinstance(dist, LogNormal | Pareto) and not 1 <= dist.min_tokens <= dist.max_tokens)
    )
    if bad:
        raise ValueError(f"invalid length distribution {dist}")
    return dist


# ---- endpoint mix ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndpointMix:
    """Relative weights of the four request kinds."""

    chat_stream: float = 4.0
    chat: float = 1.0
    completions_stream: float = 2.0
    completions: float = 1.0

    @classmethod
    def parse(cls, spec: str) -> EndpointMix:
        """'chat_stream=4,chat=1' (kinds not named get weight 0)."""
        weights = dict.fromkeys(ENDPOINTS, 0.0)
        for pair in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = pair.partition("=")
            if not sep or key not in weights or float(value) < 0:
                raise ValueError(f"mix: expected kind=weight with kind in {ENDPOINTS}: {pair!r}")
            weights[key] = float(value)
        if sum(weights.values()) <= 0:
            raise ValueError("mix: at least one weight must be positive")
        return cls(**weights)

    def choose(self, rng: random.Random) -> str:
        return rng.choices(ENDPOINTS, weights=[getattr(self, e) for e in ENDPOINTS])[0]


# ---- sessions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    seed: int = 0
    input_tokens: LengthDist = Fixed(128)  # per user message
    output_tokens: LengthDist = Fixed(32)  # max_tokens per request
    shared_prefix_tokens: int = 0  # > 0: one system prompt of this length shared by all sessions
    num_turns: int = 1  # user messages per session (multi-turn chat when > 1)
    mix: EndpointMix = field(default_factory=EndpointMix)

    def __post_init__(self) -> None:
        if self.shared_prefix_tokens < 0 or self.num_turns < 1:
            raise ValueError("shared_prefix_tokens must be ≥ 0 and num_turns ≥ 1")


MODES = {
    "single": {},
    "shared-prefix": {"shared_prefix_tokens": 256},
    "multi-turn": {"num_turns": 3},
}


@dataclass(frozen=True, slots=True)
class Turn:
    user_text: str
    max_tokens: int
    input_tokens: int  # the length user_text was cut to (exact with a tokenizer)


@dataclass(frozen=True, slots=True)
class Session:
    index: int
    endpoint: str  # one of ENDPOINTS
    system_prompt: str | None
    turns: tuple[Turn, ...]

    @property
    def stream(self) -> bool:
        return self.endpoint.endswith("_stream")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.startswith("chat")

    def messages(self, turn: int, replies: list[str]) -> list[dict[str, str]]:
        """Chat messages for `turn` (0-based): system, then user/assistant pairs so far.
        replies[k] is the server's answer to turn k, for k < turn."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for k in range(turn):
            out.append({"role": "user", "content": self.turns[k].user_text})
            out.append({"role": "assistant", "content": replies[k]})
        out.append({"role": "user", "content": self.turns[turn].user_text})
        return out

    def prompt(self, turn: int, replies: list[str]) -> str:
        """The completions-endpoint prompt: the same conversation as a plain transcript."""
        parts = [self.system_prompt] if self.system_prompt else []
        if self.num_turns == 1:
            return "\n\n".join([*parts, self.turns[0].user_text])
        for k in range(turn):
            parts.append(f"User: {self.turns[k].user_text}\nAssistant: {replies[k]}")
        parts.append(f"User: {self.turns[turn].user_text}\nAssistant:")
        return "\n\n".join(parts)

    @property
    def num_turns(self) -> int:
        return len(self.turns)


class Workload:
    """Builds session i from (config, i) alone; holds the shared system prompt, if any."""

    def __init__(self, config: WorkloadConfig, source: TextSource) -> None:
        self.config = config
        self.source = source
        prefix_rng = random.Random(f"{config.seed}/shared-prefix")
        self.shared_prefix = (
            source.text(prefix_rng.randrange(source.num_positions), config.shared_prefix_tokens)
            if config.shared_prefix_tokens
            else None
        )

    def session(self, index: int) -> Session:
        rng = random.Random(f"{self.config.seed}/{index}")
        endpoint = self.config.mix.choose(rng)
        turns = tuple(self._turn(rng) for _ in range(self.config.num_turns))
        return Session(index, endpoint, self.shared_prefix, turns)

    def _turn(self, rng: random.Random) -> Turn:
        input_tokens = self.config.input_tokens.sample(rng)
        max_tokens = self.config.output_tokens.sample(rng)
        text = self.source.text(rng.randrange(self.source.num_positions), input_tokens)
        return Turn(user_text=text, max_tokens=max_tokens, input_tokens=input_tokens)


def build_config(
    mode: str = "single",
    seed: int = 0,
    input_tokens: str = "128",
    output_tokens: str = "32",
    mix: str | None = None,
    shared_prefix_tokens: int | None = None,
    num_turns: int | None = None,
) -> WorkloadConfig:
    """The config from command-line strings; explicit numbers override the mode's defaults."""
    if mode not in MODES:
        raise ValueError(f"unknown workload mode {mode!r}; use one of {list(MODES)}")
    overrides: dict[str, int] = dict(MODES[mode])
    if shared_prefix_tokens is not None:
        overrides["shared_prefix_tokens"] = shared_prefix_tokens
    if num_turns is not None:
        overrides["num_turns"] = num_turns
    return WorkloadConfig(
        seed=seed,
        input_tokens=parse_length(input_tokens),
        output_tokens=parse_length(output_tokens),
        mix=EndpointMix.parse(mix) if mix else EndpointMix(),
        **overrides,
    )
