"""Workloads: sessions of turns, drawn from a seed (chat, agent loops, document QA) or read from a trace.

A workload is a list of sessions. A session starts at its arrival time (Poisson arrivals, seeded) and
sends its turns one after another, each after the previous answer plus a think time. With
``carry_history`` a turn's prompt is the previous prompt + the previous answer + the new text, so turns
share history as a chat's do; otherwise each turn is the shared prefix + its own text. Arrivals never
wait for the server (open loop); only the turns of one session depend on each other, as a user's do.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvmanager.checks import check_int, check_number, is_int

# User text is drawn from ids 1..255: valid for every vocabulary here, byte-level ones included.
_TEXT_IDS = (1, 255)


# -- workloads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    text: tuple[int, ...] | str      # new user text: token ids, or a string the server tokenizes
    max_tokens: int
    think_s: float = 0.0             # pause after the previous answer (or the session's start)


@dataclass(frozen=True)
class Session:
    session_id: str
    start_s: float
    turns: tuple[Turn, ...]
    prefix: tuple[int, ...] = ()     # shared text before the first turn (system prompt, document)
    carry_history: bool = True

    @property
    def num_requests(self) -> int:
        return len(self.turns)


def _text(rng: random.Random, mean: int) -> tuple[int, ...]:
    """Random token ids, length uniform in [mean/2, 3 mean/2] (at least 1)."""
    n = max(1, rng.randint(mean - mean // 2, mean + mean // 2))
    return tuple(rng.randint(*_TEXT_IDS) for _ in range(n))


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """``n`` Poisson arrival times at ``rate`` per second, the first at 0."""
    t, out = 0.0, []
    for i in range(n):
        out.append(round(t, 6))
        t += rng.expovariate(rate)
    return out


def _start(seed: int, sessions: int, turns: int, rate: float, system_tokens: int, min_system: int,
           user_tokens: int, max_tokens: int, think_s: float) -> random.Random:
    """Check a session workload's knobs (naming the bad one); its random generator."""
    for name, v, low in (("sessions", sessions, 1), ("turns", turns, 1), ("system_tokens", system_tokens, min_system),
                         ("user_tokens", user_tokens, 1), ("max_tokens", max_tokens, 1)):
        check_int(name, v, low)
    check_number("rate", rate, 0, above=True)
    check_number("think_s", think_s, 0)
    check_int("seed", seed, -2**63)
    return random.Random(seed)


def _turns(rng: random.Random, turns: int, user_tokens: int, max_tokens: int, think_s: float) -> tuple:
    """New user text each turn; the first goes at once, later ones after an exponential think time."""
    return tuple(Turn(_text(rng, user_tokens), max_tokens, rng.expovariate(1 / think_s) if think_s and t else 0.0)
                 for t in range(turns))


def _popular(rng: random.Random, n: int, skew: float) -> int:
    """One of ``n`` shared prefixes: uniformly (``skew`` 0) or Zipf-like, prefix k drawn with weight
    1 / (k + 1) ** skew, as a few apps' prompts or documents dominate real traffic."""
    if not skew:
        return rng.randrange(n)
    return rng.choices(range(n), weights=[1 / (k + 1) ** skew for k in range(n)])[0]


def multi_turn_chat(*, sessions: int = 24, turns: int = 4, rate: float = 2.0, system_tokens: int = 2048,
                    user_tokens: int = 256, max_tokens: int = 64, think_s: float = 0.5,
                    seed: int = 0, system_prompts: int | None = None, popularity: float = 0.0) -> list[Session]:
    """Chats: a system prompt, then turns whose prompt is the history plus new user text. Each user has
    their own system prompt, or, with ``system_prompts`` = k, draws one of k shared ones (k apps), with
    ``popularity`` skew (``_popular``)."""
    rng = _start(seed, sessions, turns, rate, system_tokens, 0, user_tokens, max_tokens, think_s)
    if system_prompts is not None:
        check_int("system_prompts", system_prompts, 1)
    check_number("popularity", popularity, 0)
    shared = [_text(rng, system_tokens) if system_tokens else () for _ in range(system_prompts or 0)]
    starts = _arrivals(rng, sessions, rate)
    out = []
    for i, start in enumerate(starts):
        if shared:
            system = shared[_popular(rng, len(shared), popularity)]
        else:
            system = _text(rng, system_tokens) if system_tokens else ()
        out.append(Session(f"chat{i}", start, _turns(rng, turns, user_tokens, max_tokens, think_s),
                           prefix=system, carry_history=True))
    return out


def agent_loops(*, sessions: int = 12, turns: int = 4, rate: float = 1.0, system_tokens: int = 4096,
                user_tokens: int = 192, max_tokens: int = 48, think_s: float = 0.2, seed: int = 0) -> list[Session]:
    """Agents over one long system prompt shared by all: a task, then tool outputs fed back each step."""
    rng = _start(seed, sessions, turns, rate, system_tokens, 1, user_tokens, max_tokens, think_s)
    shared = _text(rng, system_tokens)
    starts = _arrivals(rng, sessions, rate)
    return [Session(f"agent{i}", start, _turns(rng, turns, user_tokens, max_tokens, think_s), prefix=shared,
                    carry_history=True) for i, start in enumerate(starts)]


def document_qa(*, sessions: int = 24, turns: int = 1, rate: float = 1.0, system_tokens: int = 6144,
                user_tokens: int = 64, max_tokens: int = 16, think_s: float = 0.0, seed: int = 0,
                documents: int = 4, popularity: float = 0.0) -> list[Session]:
    """Long-document QA: each request is one of ``documents`` long documents plus a short question.

    ``system_tokens`` is the document length; ``turns`` questions per session, each on its own (no
    history): long prompts, short answers, documents shared across sessions, drawn with ``popularity``
    skew (``_popular``).
    """
    check_number("popularity", popularity, 0)
    for name, v, low in (("sessions", sessions, 1), ("turns", turns, 1), ("system_tokens", system_tokens, 1),
                         ("user_tokens", user_tokens, 1), ("max_tokens", max_tokens, 1), ("documents", documents, 1)):
        check_int(name, v, low)
    check_number("rate", rate, 0, above=True)
    check_number("think_s", think_s, 0)
    check_int("seed", seed, -2**63)
    rng = random.Random(seed)
    docs = [_text(rng, system_tokens) for _ in range(documents)]
    starts = _arrivals(rng, sessions, rate)
    return [Session(f"qa{i}", start, tuple(
        Turn(_text(rng, user_tokens), max_tokens, rng.expovariate(1 / think_s) if think_s and t else 0.0)
        for t in range(turns)), prefix=docs[_popular(rng, documents, popularity)], carry_history=False)
        for i, start in enumerate(starts)]


WORKLOADS: dict[str, Callable[..., list[Session]]] = {
    "chat": multi_turn_chat, "agent": agent_loops, "qa": document_qa}

_TRACE_FIELDS = ("arrival_s", "prompt", "prompt_token_ids", "max_tokens")


def parse_trace(lines, source: str = "trace") -> list[Session]:
    """A JSONL trace: one request per line, ``{"arrival_s": 0.5, "prompt_token_ids": [...] | "prompt":
    "...", "max_tokens": 32}``. Blank lines are skipped; anything else wrong is a ValueError naming the
    line and the field. Requests are sorted by arrival time (stable)."""
    sessions = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(_TRACE_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(_TRACE_FIELDS)}")
        for name in ("arrival_s", "max_tokens"):
            if name not in obj:
                raise ValueError(f"{where}: field {name!r} is missing")
        try:
            check_number("field 'arrival_s'", obj["arrival_s"], 0)
            check_int("field 'max_tokens'", obj["max_tokens"], 1)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
        if has_text == has_ids:
            raise ValueError(f"{where}: give exactly one of fields 'prompt' and 'prompt_token_ids'")
        if has_text:
            prompt = obj["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r:.60}")
        else:
            prompt = obj["prompt_token_ids"]
            if not isinstance(prompt, list) or not prompt or not all(
                    is_int(t) and t >= 0 for t in prompt):
                raise ValueError(f"{where}: field 'prompt_token_ids' must be a non-empty list of integers "
                                 f">= 0, got {prompt!r:.60}")
            prompt = tuple(prompt)
        sessions.append(Session(f"trace{number}", float(obj["arrival_s"]),
                                (Turn(prompt, obj["max_tokens"]),), carry_history=False))
    if not sessions:
        raise ValueError(f"{source}: holds no requests")
    return sorted(sessions, key=lambda s: s.start_s)


def load_trace(path: str) -> list[Session]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace(f, path)
    except OSError as exc:
        raise ValueError(f"trace {path!r}: cannot read it: {exc.strerror or exc}") from None
