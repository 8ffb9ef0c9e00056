"""The retention bench's workload families: token ids only, fixed by a seed, so every system sees the same
tokens (a request's answer is part of the workload, never sampled).

A workload is sessions of turns and an arrival order (one session index per turn). A turn's prompt is its
session's history (every earlier prompt and answer), cut to ``keep`` tokens when the turn edits it, then
its new tokens. The serving loop (``retention.serve``) releases turns in arrival order while fewer than
``backlog`` requests wait or run; a turn whose session still has one in flight waits for it (a user reads
the answer before writing again).

Families (sizes in tokens, each drawn uniformly in the range given):
- chat: 48 sessions x 6 turns; first message 200-1000, later ones 30-400, answers 50-400; every session
  starts at once, so a session's next turn queues behind every other session's (cyclic reuse).
- siblings: 6 system prompts of 1500-3000; 240 requests, each a system prompt (uniform) and its own
  question of 20-200; answers 20-200.
- agent: 24 sessions x 8 tool-loop turns; one shared 2000-token system prompt (the tools) and a task of
  100-400; each answer (a tool call) 30-150, each later turn adds a tool result of 100-1500.
- edit: chat's shape (32 sessions x 8 turns); after the first, half the turns cut the history at a random
  point of its second half and continue from there (regenerate an answer, edit an earlier message).
- zipf: 400 turns of 128 users drawn with Zipf popularity (exponent 1.1: a few hot, a long tail), at
  most 32 requests waiting or running; a user's session restarts (a new first message, no history) once
  its history passes 6000 tokens.
- phase: chat (24 x 4), then shared system prompts (4 prompts, 96 requests), then agent loops (12 x 6)
  in one trace: each phase's turns arrive after the previous phase's.
- rag: a shared system prompt of 300-800; 30 documents of 200-1500; 240 requests, each the system
  prompt, 1-3 distinct documents in any order drawn with Zipf popularity (exponent 1.0), a question of
  20-150; answers 20-200.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

VOCAB = 32000


@dataclass(frozen=True)
class Turn:
    new: tuple[int, ...]       # tokens appended to the (possibly cut) history to form this turn's prompt
    output: tuple[int, ...]    # the answer (fixed by the seed)
    keep: float = 1.0          # fraction of the history kept before ``new`` (an edit: < 1)


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    sessions: tuple[Session, ...]
    order: tuple[int, ...]     # arrival order: one session index per turn, each session's turns in order
    backlog: int | None = None  # most requests waiting or running at once (None: every session at once)

    def prompts(self) -> list[list[list[int]]]:
        """Per session, per turn: the prompt."""
        out = []
        for s in self.sessions:
            history: list[int] = []
            turns = []
            for t in s.turns:
                if t.keep < 1.0:
                    history = history[:int(len(history) * t.keep)]
                history = history + list(t.new)
                turns.append(history)
                history = history + list(t.output)
            out.append(turns)
        return out

    @property
    def num_requests(self) -> int:
        return len(self.order)


def _ids(rng: random.Random, lo: int, hi: int) -> tuple[int, ...]:
    return tuple(rng.randint(1, VOCAB) for _ in range(rng.randint(lo, hi)))


def _round_robin(sessions) -> tuple[int, ...]:
    """Every session's first turn, then every second turn, ...: all sessions start at once."""
    longest = max(len(s.turns) for s in sessions)
    return tuple(i for t in range(longest) for i, s in enumerate(sessions) if t < len(s.turns))


def _zipf(rng: random.Random, n: int, exponent: float):
    weights = [1.0 / (i + 1) ** exponent for i in range(n)]
    order = list(range(n))
    rng.shuffle(order)                      # which items are hot is part of the draw

    def draw() -> int:
        return order[rng.choices(range(n), weights)[0]]
    return draw


def _sessions(turns_per_session) -> Workload:
    sessions = tuple(Session(tuple(ts)) for ts in turns_per_session)
    return Workload(sessions, _round_robin(sessions))


def chat(seed, sessions=48, turns=6, first=(200, 1000), message=(30, 400), answer=(50, 400)) -> Workload:
    rng = random.Random(f"chat/{seed}")
    return _sessions([[Turn(_ids(rng, *(first if t == 0 else message)), _ids(rng, *answer))
                       for t in range(turns)] for _ in range(sessions)])


def siblings(seed, prompts=6, requests=240, system=(1500, 3000), question=(20, 200),
             answer=(20, 200)) -> Workload:
    rng = random.Random(f"siblings/{seed}")
    systems = [_ids(rng, *system) for _ in range(prompts)]
    return _sessions([[Turn(rng.choice(systems) + _ids(rng, *question), _ids(rng, *answer))]
                      for _ in range(requests)])


def agent(seed, sessions=24, turns=8, system=2000, task=(100, 400), tool=(100, 1500),
          answer=(30, 150)) -> Workload:
    rng = random.Random(f"agent/{seed}")
    shared = _ids(rng, system, system)
    return _sessions([[Turn(shared + _ids(rng, *task) if t == 0 else _ids(rng, *tool), _ids(rng, *answer))
                       for t in range(turns)] for _ in range(sessions)])


def edit(seed, sessions=32, turns=8, first=(200, 1000), message=(30, 400), answer=(50, 400), edits=0.5,
         cut=0.5) -> Workload:
    rng = random.Random(f"edit/{seed}")
    out = []
    for _ in range(sessions):
        ts = []
        for t in range(turns):
            keep = rng.uniform(cut, 1.0) if t and rng.random() < edits else 1.0
            ts.append(Turn(_ids(rng, *(first if t == 0 else message)), _ids(rng, *answer), keep))
        out.append(ts)
    return _sessions(out)


def zipf(seed, requests=400, sessions=128, exponent=1.1, restart=6000, first=(200, 1000), message=(30, 400),
         answer=(50, 400), backlog=32) -> Workload:
    rng = random.Random(f"zipf/{seed}")
    draw = _zipf(rng, sessions, exponent)
    current = {}          # user -> index of its current session
    length = {}           # session index -> its history's length so far
    turns: list[list[Turn]] = []
    order = []
    for _ in range(requests):
        user = draw()
        s = current.get(user)
        if s is None or length[s] > restart:
            s = current[user] = len(turns)
            turns.append([])
            length[s] = 0
        turn = Turn(_ids(rng, *(message if turns[s] else first)), _ids(rng, *answer))
        turns[s].append(turn)
        length[s] += len(turn.new) + len(turn.output)
        order.append(s)
    return Workload(tuple(Session(tuple(ts)) for ts in turns), tuple(order), backlog)


def phase(seed, chat_shape=None, siblings_shape=None, agent_shape=None, backlog=24) -> Workload:
    """chat, then shared system prompts, then agent loops: each phase's sessions after the previous one's."""
    parts = [chat(f"phase/{seed}", **(chat_shape or dict(sessions=24, turns=4))),
             siblings(f"phase/{seed}", **(siblings_shape or dict(prompts=4, requests=96))),
             agent(f"phase/{seed}", **(agent_shape or dict(sessions=12, turns=6)))]
    sessions, order = [], []
    for p in parts:
        order += [len(sessions) + i for i in p.order]
        sessions += p.sessions
    return Workload(tuple(sessions), tuple(order), backlog=backlog)


def rag(seed, requests=240, documents=30, system=(300, 800), document=(200, 1500), question=(20, 150),
        answer=(20, 200), exponent=1.0, most=3) -> Workload:
    rng = random.Random(f"rag/{seed}")
    shared = _ids(rng, *system)
    docs = [_ids(rng, *document) for _ in range(documents)]
    draw = _zipf(rng, documents, exponent)
    out = []
    for _ in range(requests):
        chosen: list[int] = []
        k = rng.randint(1, min(most, documents))
        while len(chosen) < k:
            d = draw()
            if d not in chosen:
                chosen.append(d)
        tokens = shared + tuple(t for d in chosen for t in docs[d]) + _ids(rng, *question)
        out.append([Turn(tokens, _ids(rng, *answer))])
    return _sessions(out)


FAMILIES = {"chat": chat, "siblings": siblings, "agent": agent, "edit": edit, "zipf": zipf, "phase": phase,
            "rag": rag}


# -- shapes outside the ones above ---------------------------------------------------------------------
# The families' defaults are the shapes the retention policy was developed on. ``drawn_shape`` draws each
# family's own parameters from wide ranges instead (how many sessions, turns, documents, how hot the popular
# ones are, how long every part is), so a check can run the same ideas on workloads nobody tuned for.
# Traces stay about the size of the defaults' (120-500 requests) so a grid runs in minutes.

def _span(rng: random.Random, lo: float, hi: float, stretch: tuple[float, float] = (1.5, 5.0)) -> tuple[int, int]:
    """A token range: its low end log-uniform in [lo, hi], its high end that times a drawn stretch."""
    low = max(1, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    return low, max(low, round(low * rng.uniform(*stretch)))


def _conversation(rng: random.Random, requests: int) -> dict:
    sessions = rng.randint(8, 96)
    return dict(sessions=sessions, turns=max(2, min(rng.randint(2, 12), requests // sessions)),
                first=_span(rng, 30, 1500), message=_span(rng, 10, 400), answer=_span(rng, 4, 400))


def drawn_shape(family: str, rng: random.Random) -> dict:
    """Keyword arguments for ``FAMILIES[family]``, drawn with ``rng`` from ranges wider than the defaults'."""
    if family in ("chat", "edit"):
        shape = _conversation(rng, rng.randint(150, 400))
        if family == "edit":
            shape.update(edits=rng.uniform(0.1, 0.9), cut=rng.uniform(0.0, 0.9))
        return shape
    if family == "siblings":
        return dict(prompts=rng.randint(1, 32), requests=rng.randint(120, 400), system=_span(rng, 100, 4000, (1, 2)),
                    question=_span(rng, 4, 300), answer=_span(rng, 4, 300))
    if family == "agent":
        sessions = rng.randint(4, 48)
        return dict(sessions=sessions, turns=max(2, min(rng.randint(2, 16), 320 // sessions)),
                    system=rng.randint(0, 6000), task=_span(rng, 20, 600), tool=_span(rng, 20, 1500),
                    answer=_span(rng, 4, 300))
    if family == "zipf":
        return dict(requests=rng.randint(200, 500), sessions=rng.randint(8, 256), exponent=rng.uniform(0.4, 1.6),
                    restart=rng.randint(1000, 12000), first=_span(rng, 30, 1500), message=_span(rng, 10, 400),
                    answer=_span(rng, 4, 400), backlog=rng.randint(4, 64))
    if family == "phase":
        conv = _conversation(rng, 120)
        return dict(chat_shape=conv, siblings_shape=dict(drawn_shape("siblings", rng), requests=rng.randint(40, 120)),
                    agent_shape=dict(drawn_shape("agent", rng), sessions=rng.randint(4, 16)),
                    backlog=rng.randint(4, 64))
    if family == "rag":
        documents = rng.randint(3, 120)
        return dict(requests=rng.randint(120, 400), documents=documents, system=_span(rng, 1, 1500, (1, 2)),
                    document=_span(rng, 50, 2000, (1, 4)), question=_span(rng, 4, 300), answer=_span(rng, 4, 300),
                    exponent=rng.uniform(0.3, 1.6), most=rng.randint(1, 5))
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
