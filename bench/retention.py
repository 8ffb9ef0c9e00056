"""Prefix-cache retention: hit rate of swakv vs vLLM 0.33 (dense and semantic retention), side by side, on
settings drawn at random.

Each run draws ``--draws`` settings (a fresh seed per run unless ``--seed`` replays one): window in {128,
384, 1024, 4096}, concurrency (requests running at once) in {4, 8, 16}, prefill chunk (tokens a step) in
{256, 512, 2048}, block 16, and the workloads' own seed. For each draw, each workload family
(``retention_workloads``: chat, siblings, agent, edit, zipf, phase, rag) and each layout (full, sliding,
hybrid with the drawn window; gemma3: gemma-3-27b's real layout, W 1024), it serves the trace through
every system at four pool sizes: the tightest that runs (the largest single request's peak need, or
``concurrency`` requests of mean peak need at once if more: below that the loop mostly preempts and
every system's hits fall to zero together), the size that never evicts (every block the unbounded run
ever filled: the ceiling), and two between them (geometric steps).

Pool size "per group": ``N`` blocks per group is one pool of ``N x G`` allocatable blocks plus the null
block, ``G`` the layout's number of groups, for every system; a block holds one group's layers for 16
tokens, so with equal layer counts per group all get the same KV bytes (vLLM's planner builds this layout
for hybrid models: groups of equal page size alias the same bytes). gemma3: vLLM, the ceiling and the
simulated policies hold it as five sliding groups (W 1024) per full one, one group per layer slot;
swakv as its real ``kv_layout`` for gemma-3-27b: one sliding group of 26 pool units per block, one full
group of 5 (``31 N`` units: the same KV bytes).

One serving loop drives every system (``serve``): up to ``concurrency`` requests at once, a budget of
``chunk`` tokens a step (running requests first, in admission order, then waiting ones after a prefix
lookup), one decode token a step, free on finish; when the pool is short the most recently admitted
running request is preempted (it recomputes later, through the prefix cache), as ``cluster``'s
scheduler does. Hit rate = tokens served from the prefix cache at each request's first admission / its
prompt tokens.

Columns: the ceiling (a simulated pool that never evicts, ``retention_sim``), vLLM dense (a hand-built
``KVCacheConfig``: every full sliding block cached, LRU), vLLM sem. (its engine default
``prefix_cache_retention_interval=0``, ``shared_prefix_boundary`` set after each lookup as its scheduler
does), swakv, swakv / the better vLLM, and, on single-group layouts, a clairvoyant heuristic
(``retention_sim.Belady``: evicts the block whose next use is furthest, a block's uses being the hits
that needed it in the unbounded run, the window below the hit's end for a sliding group). It is NOT an
upper bound: a hit needs a whole run of blocks, which per-block next use ignores, and a bounded pool's
shorter sliding hits need windows the unbounded run never used, so swakv can beat it (negative gaps);
an exact optimum is only computed on tiny instances (``--oracle``). Then, on layouts with full attention
(full, hybrid), ``bound``: an upper bound on the hits of any eviction policy *with the schedule of
swakv's run* (``retention_bound``: which requests were admitted and finished when; a policy with other
hits runs another schedule, which it does not bound). Last, swakv's floor: the share of
admissions at which its free queue followed plain LRU (``kvmanager/floor.py``). Then the losing cells,
each with the tokens it computed in all (prefill, decode, a preempted request's recomputation) against the
column it lost to, as the hit rate counts first admissions only, and where it stands against the floor's
reference LRU on its own admissions (behind it, and how much of that the floor wrote off; or ahead, so the loss
is to LRU's run on its own schedule); the issue's counts (for each tight-pool
miss: whether its target is above the clairvoyant heuristic, and above the bound), and the gap to the
clairvoyant heuristic per family. Rows of several seeds (``--report-from`` over their files) make one
report: each cell named by its seed, the counts summed, and a table of losing cells and tight-pool targets
by family and layout. Without vLLM (run with the main interpreter) the vLLM columns are
replaced by the simulated LRU (``sim:lru``: vLLM dense's order), and the table says so.

    PYTHONPATH=$PWD /tmp/vllm-venv/bin/python bench/retention.py --jsonl out.jsonl    # a fresh draw
    PYTHONPATH=$PWD /tmp/vllm-venv/bin/python bench/retention.py --seed 1234          # replay one
    python bench/retention.py --families chat,edit --layouts hybrid --draws 1         # no vLLM: sim:lru
    python bench/retention.py --report-from out.jsonl                                # print again
    python bench/retention.py --seed 1234 --draw 1 --families zipf --layouts hybrid --systems swakv \
        --jsonl mine.jsonl && python bench/retention.py --report-from out.jsonl,mine.jsonl  # one cell again
    python bench/retention.py --report-from a.jsonl,b.jsonl   # two seeds' grids: one report, counts summed
    python bench/retention.py --report-from a.jsonl,b.jsonl --plot standing.png   # and the counts as a picture
    python bench/retention.py --oracle               # tiny instances against the exhaustive best
    python bench/retention.py --unseen --no-vllm      # settings and workload shapes outside the grid's

``--unseen`` draws every setting from values the grid above never uses (``UNSEEN``: windows 64 to 8192,
2 to 32 running, chunks 128 to 8192) and each family's own shape (``retention_workloads.drawn_shape``:
sessions, turns, documents, popularity, every length), so a policy developed on the grid is checked on
workloads nobody tuned it for; the rows record the shape.

``--oracle`` runs tiny instances of chat, siblings and agent and searches every eviction choice for the
best hit rate any policy reaches, next to swakv and simulated LRU. Results: ``bench/results/``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvmanager import FullAttention, KVCacheManager, Request, SlidingWindow  # noqa: E402
from retention_sim import Belady, Branch, Scripted, SimManager, SimRequest, Spec, chain_hashes  # noqa: E402
from retention_bound import Timeline, hit_token_bound  # noqa: E402
from retention_workloads import FAMILIES, Workload, agent, chat, drawn_shape, siblings  # noqa: E402

BLOCK = 16
MAX_MODEL_LEN = 65536
WINDOWS = (128, 384, 1024, 4096)
CONCURRENCY = (4, 8, 16)
CHUNKS = (256, 512, 2048)
W = "W"            # the drawn window, in a layout's shape
# Window per group (None: full attention). gemma3: one group per layer slot, five sliding (W 1024) per
# full one, gemma-3's ratio; swakv holds it as its real layout (``UNITS``).
LAYOUTS = {"full": (None,), "sliding": (W,), "hybrid": (None, W), "gemma3": (1024,) * 5 + (None,)}
# swakv's real layout for gemma-3-27b (kvmanager.planning.kv_layout: 52 sliding + 10 full layers, a unit is
# 2 layers' pages): one sliding group of 26 units, one full group of 5; N blocks per group of gemma3 = 31 N
# units here.
UNITS = {"gemma3": ((26, 5), 31)}
SINGLE_GROUP = ("full", "sliding")
GOAL_FAMILIES = ("chat", "agent", "rag")   # >= 1.10x the better vLLM (or the ceiling) at the tightest pools
TOLERANCE = 0.005                          # every cell: swakv >= the better vLLM - this
SYSTEMS = ("swakv", "vllm-dense", "vllm-sem", "sim:lru", "clairvoyant")
# ``--unseen``: settings the grid above never draws (1000 among the windows: not a whole number of 16-token
# blocks, as Phi-3's 2047 is not), each family's own shape drawn as well.
UNSEEN = dict(window=(64, 256, 512, 1000, 2048, 8192), concurrency=(2, 6, 12, 24, 32), chunk=(128, 1024, 4096, 8192))


def windows_of(layout: str, window: int) -> tuple:
    return tuple(window if w == W else w for w in LAYOUTS[layout])


# -- managers behind one interface -----------------------------------------------------------------
class SwakvAdapter:
    """swakv's manager, through its public API only (so the bench outlives internal restructures)."""

    def __init__(self, windows, num_blocks: int, block_size: int = BLOCK, units=None):
        specs = [FullAttention(block_size) if w is None else SlidingWindow(block_size, window=w) for w in windows]
        widths = None
        if units is not None:      # one group per kind, composites of pool units (``UNITS``)
            (widths, per_block), groups = units, len(windows)
            kinds = list(dict.fromkeys(windows))
            specs = [specs[windows.index(w)] for w in kinds]
            num_blocks = (num_blocks - 1) // groups * per_block + 1
        self.mgr = KVCacheManager(specs, num_blocks=num_blocks, enable_prefix_caching=True,
                                  max_model_len=MAX_MODEL_LEN, widths=widths)

    def request(self, rid: str, prompt: list[int]):
        return Request(rid, prompt)

    def lookup(self, req):
        return self.mgr.get_computed_blocks(req)

    def allocate(self, req, n: int, hit: int = 0, blocks=None) -> bool:
        return self.mgr.allocate_slots(req, n, hit, blocks) is not None

    def admitted(self, req, hit: int, index: int) -> None:
        req.num_computed_tokens += hit

    def advance(self, req, n: int) -> None:
        req.num_computed_tokens += n

    def append(self, req, token: int) -> None:
        req.append_output_token_ids([token])

    def preempt(self, req) -> None:
        self.mgr.preempt(req)

    def free(self, req) -> None:
        self.mgr.free(req)

    def report(self) -> dict:
        floor = getattr(self.mgr.pool.free, "floor", None)
        return {"floor": floor.report()} if floor is not None else {}


class SimAdapter(SwakvAdapter):
    """The trace simulator; with ``num_blocks=None`` the unbounded-pool ceiling, which also records, per
    first admission, the blocks its hit needed (the clairvoyant policy's future)."""

    def __init__(self, windows, num_blocks: int | None, policy="lru", record: bool = False,
                 block_size: int = BLOCK):
        self.mgr = SimManager([Spec(block_size, w) for w in windows], num_blocks, policy)
        self.block_size = block_size
        self.record = record
        self.hit_tokens = 0
        self.needs: dict = {}
        self.need_sets: dict = {}

    def request(self, rid: str, prompt: list[int]):
        return SimRequest(rid, prompt)

    def admitted(self, req, hit: int, index: int) -> None:
        req.num_computed_tokens += hit
        if index < 0:
            return
        self.hit_tokens += hit
        self.mgr.admitted(req.request_id)
        if self.record:
            hashes = req.block_hashes(self.block_size)
            keys = {(g, hashes[i]) for g, spec in enumerate(self.mgr.specs) for i in spec.needed_blocks(hit)}
            self.need_sets[req.request_id] = keys
            for k in keys:
                self.needs.setdefault(k, []).append((index, req.request_id))

    def report(self) -> dict:
        return {}


def vllm_adapter_class():
    """An adapter class for vLLM 0.33's manager, or None when vLLM is not importable here."""
    try:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                                KVCacheTensor, SlidingWindowSpec)
        from vllm.v1.request import Request as VRequest, RequestStatus
    except Exception as exc:  # noqa: BLE001 - any import failure means "no baseline here"
        print(f"[vLLM baseline unavailable: {type(exc).__name__}: {exc}]", file=sys.stderr)
        return None
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    params = SamplingParams(max_tokens=1 << 20)

    class VllmAdapter:
        def __init__(self, windows, num_blocks: int, semantic: bool):
            kw = dict(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
            specs = [FullAttentionSpec(**kw) if w is None else SlidingWindowSpec(**kw, sliding_window=w)
                     for w in windows]
            groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
            page = specs[0].page_size_bytes
            # As vLLM's planner lays out groups of equal page size: each group's tensor aliases the same
            # bytes from offset 0 (a block id belongs to one group at a time).
            tensors = [KVCacheTensor(size=page * num_blocks, layers=[f"layer.{i}"], layer_stride=page * num_blocks,
                                     block_stride=page) for i in range(len(specs))]
            cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
            if semantic:
                cfg.prefix_cache_retention_interval = 0      # the engine default (CacheConfig)
            self.mgr = VKVCacheManager(cfg, max_model_len=MAX_MODEL_LEN, scheduler_block_size=BLOCK,
                                       hash_block_size=BLOCK, enable_caching=True)

        def request(self, rid: str, prompt: list[int]):
            return VRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                            pooling_params=None, block_hasher=hasher)

        def lookup(self, req):
            blocks, n, boundary = self.mgr.get_computed_blocks(req)
            req.shared_prefix_boundary = boundary     # what its scheduler does after every lookup
            return blocks, n

        def allocate(self, req, n: int, hit: int = 0, blocks=None) -> bool:
            return self.mgr.allocate_slots(req, n, hit, blocks) is not None

        def admitted(self, req, hit: int, index: int) -> None:
            req.num_computed_tokens += hit
            req.status = RequestStatus.RUNNING

        def advance(self, req, n: int) -> None:
            req.num_computed_tokens += n

        def append(self, req, token: int) -> None:
            req.append_output_token_ids(token)

        def preempt(self, req) -> None:       # as its scheduler's _preempt_request
            self.mgr.free(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.num_preemptions += 1

        def free(self, req) -> None:
            self.mgr.free(req)
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED

        def report(self) -> dict:
            return {}

    return VllmAdapter


# -- the serving loop ------------------------------------------------------------------------------
class Live:
    __slots__ = ("rid", "session", "turn", "prompt", "output", "handle", "num_out", "index")

    def __init__(self, session: int, turn: int, prompt: list[int], output: tuple[int, ...]):
        self.rid = f"s{session}t{turn}"
        self.session, self.turn, self.prompt, self.output = session, turn, prompt, output
        self.handle = None
        self.num_out = 0
        self.index = -1            # first-admission order; -1 until admitted


def serve(workload: Workload, adapter, progress=None, *, step_tokens: int, max_running: int,
          timeline=None) -> dict:
    """Serve every turn of ``workload`` through ``adapter``; hits are counted at first admissions
    (``timeline``: a ``retention_bound.Timeline`` that records when each request was first admitted and
    finished, for the bound).

    Turns are released in arrival order while fewer than ``workload.backlog`` requests wait or run; a turn
    whose session has one in flight waits for it and joins the back of the queue when it finishes."""
    all_prompts = workload.prompts()
    sessions = workload.sessions
    arrivals = deque(workload.order)
    backlog = workload.backlog or len(arrivals)
    next_turn = [0] * len(sessions)
    busy = [False] * len(sessions)
    deferred = [0] * len(sessions)
    ready: deque[Live] = deque()
    running: list[Live] = []

    def enqueue(s: int) -> None:
        t = next_turn[s]
        next_turn[s] += 1
        busy[s] = True
        ready.append(Live(s, t, all_prompts[s][t], sessions[s].turns[t].output))

    stats = dict(hit_tokens=0, prompt_tokens=0, computed=0, preemptions=0, steps=0, requests=0)
    admissions = 0
    while arrivals or ready or running:
        while arrivals and len(ready) + len(running) < backlog:
            s = arrivals.popleft()
            if busy[s]:
                deferred[s] += 1
            else:
                enqueue(s)
        stats["steps"] += 1
        budget, preempted, scheduled = step_tokens, False, []
        i = 0
        while i < len(running) and budget > 0:
            live = running[i]
            req = live.handle
            n = min(len(live.prompt) + live.num_out - req.num_computed_tokens, budget)
            ok = adapter.allocate(req, n)
            while not ok:
                if running[-1] is live and n > 1:          # the last one still short: smaller chunks first
                    n //= 2
                    ok = adapter.allocate(req, n)
                    continue
                victim = running.pop()
                adapter.preempt(victim.handle)
                stats["preemptions"] += 1
                preempted = True
                ready.appendleft(victim)
                if victim is live:
                    break
                ok = adapter.allocate(req, n)
            if not ok:
                break
            scheduled.append((live, n))
            budget -= n
            i += 1
        while ready and budget > 0 and not preempted and len(running) < max_running:
            live = ready[0]
            if live.handle is None:
                live.handle = adapter.request(live.rid, live.prompt)
            req = live.handle
            blocks, hit = adapter.lookup(req)
            n = min(len(live.prompt) + live.num_out - hit, budget)
            ok = adapter.allocate(req, n, hit, blocks)
            while not ok and not running and n > 1:       # alone and still short: smaller chunks
                n //= 2
                ok = adapter.allocate(req, n, hit, blocks)
            if not ok:
                break
            ready.popleft()
            first = live.index < 0
            if first:
                live.index = admissions
                admissions += 1
                stats["hit_tokens"] += hit
                stats["prompt_tokens"] += len(live.prompt)
                if timeline is not None:
                    timeline.admit(live.rid, live.prompt, live.output, [x.rid for x in running])
            adapter.admitted(req, hit, live.index if first else -1)
            running.append(live)
            scheduled.append((live, n))
            budget -= n
        if not scheduled:
            raise RuntimeError(f"no progress: {ready[0].rid} ({len(ready[0].prompt)} tokens) fits nowhere")
        for live, n in scheduled:
            req = live.handle
            adapter.advance(req, n)
            stats["computed"] += n
            if req.num_computed_tokens == len(live.prompt) + live.num_out:   # sampled: the answer's next token
                adapter.append(req, live.output[live.num_out])
                live.num_out += 1
                if live.num_out == len(live.output):
                    if timeline is not None:
                        timeline.finish(live.rid, [x.rid for x in running[:running.index(live)]])
                    adapter.free(req)
                    running.remove(live)
                    stats["requests"] += 1
                    if progress is not None:
                        progress.update(1)
                    s = live.session
                    busy[s] = False
                    if deferred[s]:
                        deferred[s] -= 1
                        enqueue(s)
    stats["hit_rate"] = stats["hit_tokens"] / stats["prompt_tokens"]
    return stats


# -- settings, pools -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Draw:
    index: int
    window: int
    concurrency: int
    chunk: int
    workload_seed: int
    unseen: bool = False       # settings from ``UNSEEN``, each family's shape drawn (``workload_of``)


def draw_settings(seed: int, draws: int, unseen: bool = False) -> list[Draw]:
    if unseen:
        rng = random.Random(f"retention-unseen/{seed}")
        return [Draw(d, rng.choice(UNSEEN["window"]), rng.choice(UNSEEN["concurrency"]),
                     rng.choice(UNSEEN["chunk"]), rng.randrange(1 << 30), True) for d in range(draws)]
    rng = random.Random(f"retention/{seed}")
    return [Draw(d, rng.choice(WINDOWS), rng.choice(CONCURRENCY), rng.choice(CHUNKS), rng.randrange(1 << 30))
            for d in range(draws)]


def workload_of(draw: Draw, family: str) -> tuple[Workload, dict]:
    """The draw's trace of ``family`` and the shape it was built with ({}: the family's defaults)."""
    shape = drawn_shape(family, random.Random(f"shape/{draw.workload_seed}/{family}")) if draw.unseen else {}
    return FAMILIES[family](draw.workload_seed, **shape), shape


def peak_needs(workload: Workload, windows) -> list[int]:
    """Blocks (all groups) each request holds at its peak, alone: its whole length for full attention, the
    window and the block being written for a sliding group."""
    out = []
    for turns, session in zip(workload.prompts(), workload.sessions):
        for prompt, turn in zip(turns, session.turns):
            blocks = -(-(len(prompt) + len(turn.output)) // BLOCK)
            out.append(sum(blocks if w is None else min(blocks, -(-(w - 1) // BLOCK) + 2) for w in windows))
    return out


def tightest_units(workload: Workload, windows, concurrency: int) -> int:
    """Blocks for the largest request and for ``concurrency`` requests of mean peak need at once: below
    it the serving loop mostly preempts, and every policy's hits fall towards zero together."""
    needs = peak_needs(workload, windows)
    return max(max(needs), round(concurrency * sum(needs) / len(needs)))


def pool_sizes(workload: Workload, layout: str, windows, concurrency: int, ceiling_blocks: int) -> list[int]:
    """Four pool sizes per group: the tightest that runs (``tightest_units``), the size that never evicts
    (every block the unbounded run filled), two geometric steps between. For gemma3 the tightest also
    fits swakv's units layout (26 + 5 units per pair of blocks)."""
    groups = len(windows)
    tight = -(-tightest_units(workload, windows, concurrency) // groups)
    if layout in UNITS:
        (widths, per_block), kinds = UNITS[layout], list(dict.fromkeys(windows))
        units = sum(wd * tightest_units(workload, (k,), concurrency) for wd, k in zip(widths, kinds))
        tight = max(tight, -(-units // per_block))
    top = -(-ceiling_blocks // groups) + 1
    if top <= tight:
        return [top]
    r = (top / tight) ** (1 / 3)
    return sorted({tight, round(tight * r), round(tight * r * r), top})


# -- the grid --------------------------------------------------------------------------------------
def run_unit(job) -> list[dict]:
    """One (draw, family, layout): the ceiling, then every system at every pool size."""
    draw, family, layout, with_vllm, with_lru, only = job
    draw = Draw(**draw)
    workload, shape = workload_of(draw, family)
    windows = windows_of(layout, draw.window)
    kw = dict(step_tokens=draw.chunk, max_running=draw.concurrency)
    # ``window``: this layout's sliding window (gemma3's own 1024; none for full); ``drawn_window``: the draw's
    base = dict(draw=draw.index, family=family, layout=layout, drawn_window=draw.window,
                window=draw.window if W in LAYOUTS[layout] else (1024 if layout == "gemma3" else None),
                concurrency=draw.concurrency, chunk=draw.chunk, workload_seed=draw.workload_seed,
                **(dict(unseen=True, shape=shape) if draw.unseen else {}))
    rows = []
    clairvoyant = layout in SINGLE_GROUP
    bounded = None in windows and layout not in UNITS      # retention_bound: full attention's hits
    t0 = time.process_time()
    ceiling = SimAdapter(windows, None, record=clairvoyant)
    stats = serve(workload, ceiling, **kw)
    rows.append(dict(base, system="ceiling", pool_per_group=None, seconds=round(time.process_time() - t0, 2),
                     **stats))
    vllm_cls = vllm_adapter_class() if with_vllm else None
    systems = ["swakv"] + (["vllm-dense", "vllm-sem"] if vllm_cls else []) + (["sim:lru"] if with_lru else []) \
        + (["clairvoyant"] if clairvoyant else [])
    systems = [s for s in systems if not only or s in only]
    for pool in pool_sizes(workload, layout, windows, draw.concurrency, len(ceiling.mgr.blocks) - 1):
        num_blocks = pool * len(windows) + 1
        for system in systems:
            t0 = time.process_time()
            if system == "swakv":
                adapter = SwakvAdapter(windows, num_blocks, units=UNITS.get(layout))
            elif system.startswith("vllm"):
                adapter = vllm_cls(windows, num_blocks, semantic=system == "vllm-sem")
            elif system == "sim:lru":
                adapter = SimAdapter(windows, num_blocks, "lru")
            else:
                adapter = SimAdapter(windows, num_blocks, Belady(ceiling.needs, ceiling.need_sets))
            timeline = Timeline() if bounded and system in ("swakv", "clairvoyant", "sim:lru") else None
            try:
                stats = serve(workload, adapter, **kw, timeline=timeline)
            except RuntimeError as exc:        # a request that fits nowhere: reported, not hidden
                stats = dict(hit_rate=None, error=str(exc))
            if timeline is not None and stats.get("hit_rate") is not None:
                # the most any policy hits on this run's schedule (full attention; hybrid: its full group,
                # the pool's every block its room)
                stats["bound"] = hit_token_bound(timeline, num_blocks - 1, BLOCK, [w for w in windows if w]) \
                    / stats["prompt_tokens"]
            rows.append(dict(base, system=system, pool_per_group=pool, seconds=round(time.process_time() - t0, 2),
                             **stats, **adapter.report()))
    return rows


def run_grid(args) -> list[dict]:
    from tqdm import tqdm
    with_vllm = not args.no_vllm and vllm_adapter_class() is not None
    with_lru = args.lru or not with_vllm
    draws = [d for d in draw_settings(args.seed, args.draws, args.unseen) if args.draw is None or d.index == args.draw]
    jobs = [(asdict(d), f, lay, with_vllm, with_lru, args.systems) for d in draws for f in args.families
            for lay in args.layouts]
    out = open(args.jsonl, "w") if args.jsonl else None
    rows: list[dict] = []
    bar = tqdm(total=len(jobs), unit="cell", desc="retention", disable=args.quiet)

    def take(unit_rows):
        for r in unit_rows:
            r["seed"] = args.seed
            rows.append(r)
            if out:
                out.write(json.dumps(r) + "\n")
                out.flush()
        bar.update(1)
    if args.jobs > 1:
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            for unit_rows in pool.imap_unordered(run_unit, jobs):
                take(unit_rows)
    else:
        for job in jobs:
            take(run_unit(job))
    bar.close()
    if out:
        out.close()
    return rows


# -- the report ------------------------------------------------------------------------------------
def _fmt(v, width=9, digits=3) -> str:
    return f"{v:>{width}.{digits}f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"


def _against_lru(floor: dict | None) -> tuple[str, str] | None:
    """Where a losing cell's loss lies, from swakv's floor report: the kind, ``behind`` (its reference LRU hit
    more than ``TOLERANCE`` of the prompt tokens more on swakv's own admissions), ``written off`` (behind, half
    of it or more written off: the tiers came back on evidence and lost again) or ``schedule`` (not behind: the
    loss is to LRU's run on its own schedule), and the clause the report prints; None without a report."""
    if not floor or not floor.get("prompt_tokens"):
        return None
    tokens = floor["prompt_tokens"]
    ahead, off = (floor["hits"] - floor["lru_hits"]) / tokens, floor.get("forgiven", 0) / tokens
    kind = "schedule" if -ahead <= TOLERANCE else "written off" if off >= -ahead / 2 else "behind"
    clause = (f"; on its own admissions {abs(ahead):.1%} of the prompt tokens {'ahead of' if ahead >= 0 else 'behind'}"
              f" LRU" + (f" ({off:.1%} written off)" if off else ""))
    return kind, clause


def report(rows: list[dict], plot: str | None = None) -> dict:
    """Every cell side by side, the losing cells, the issue's counts, the gap to the clairvoyant policy; over
    several seeds' rows, each cell named by its seed too and the counts summed over all of them. ``plot``: a
    PNG of the same counts (``plot_standing``)."""
    # an unseen draw (``--unseen``) is another cell than the same seed's grid draw
    rows = [dict(r, seed=f"{r.get('seed')} unseen") if r.get("unseen") else r for r in rows]
    by = {(r.get("seed"), r["draw"], r["family"], r["layout"], r["pool_per_group"], r["system"]): r for r in rows}
    systems = set(r["system"] for r in rows)
    base = [s for s in ("vllm-dense", "vllm-sem") if s in systems] or (["sim:lru"] if "sim:lru" in systems else [])
    names = {"vllm-dense": "vLLM dense", "vllm-sem": "vLLM sem.", "sim:lru": "LRU (sim)"}
    seeds = sorted({r.get("seed") for r in rows}, key=str)
    several = len(seeds) > 1
    replay = str(seeds[0]).replace(" unseen", " --unseen")
    print(f"\nseed {', '.join(map(str, seeds))} (replay: --seed {replay}); hit rate = prefix-cache hit tokens / "
          f"prompt tokens at first admissions; block {BLOCK}; blocks = pool per group")

    def name(seed, d) -> str:
        return f"seed {seed} draw {d}" if several else f"draw {d}"
    if "vllm-dense" not in systems:
        print("vLLM 0.33 is not importable here: its columns are replaced by the simulated LRU (vLLM dense's "
              "order); run with /tmp/vllm-venv/bin/python for the real baseline")
    for seed, d in sorted({(r.get("seed"), r["draw"]) for r in rows}, key=lambda k: (str(k[0]), k[1])):
        r0 = next(r for r in rows if r["draw"] == d and r.get("seed") == seed)
        print(f"{name(seed, d)}: window {r0.get('drawn_window', '?')} (sliding, hybrid; gemma3 keeps its own 1024), "
              f"concurrency {r0['concurrency']}, chunk {r0['chunk']}, workload seed {r0['workload_seed']}")
        shapes = {r["family"]: r["shape"] for r in rows if r["draw"] == d and r.get("seed") == seed and "shape" in r}
        for f, shape in sorted(shapes.items()):
            print(f"  {f}: " + ", ".join(f"{k} {v}" for k, v in shape.items()))
    head = (("      seed" if several else "") + f"{'draw':>4} {'family':<9}{'layout':<8}{'W':>5}{'blocks':>8}"
            + f"{'ceiling':>9}" + "".join(f"{names[s]:>12}" for s in base)
            + f"{'swakv':>9}{'/ best':>9}{'clairv.*':>9}{'bound':>7}{'floor':>7}")
    print("(clairv.*: a clairvoyant heuristic, Belady on the unbounded run's hits: a reference, not an upper bound)")
    print("(bound: retention_bound on swakv's own schedule, full-attention layouts: the most hit tokens any "
          "policy gets with the same admission and finish times)")
    print(head)
    fam, lays = list(FAMILIES), list(LAYOUTS)
    cells = sorted(((r.get("seed"), r["draw"], r["family"], r["layout"], r["pool_per_group"]) for r in rows
                    if r["system"] == "swakv"),
                   key=lambda c: (str(c[0]), c[1], fam.index(c[2]), lays.index(c[3]), c[4]))
    pools_of: dict = {}
    for seed, d, f, lay, p in cells:
        pools_of.setdefault((seed, d, f, lay), []).append(p)
    tally: dict = {}       # (family, layout) -> [cells, losing, targets, met]
    losing, goal_b, short_b, errors = [], 0, [], []
    fewer_computed = 0
    lost_where: dict[str, int] = {}
    n_a = 0
    gaps: dict = {}
    margins, goals = [], []      # (family, swakv - the better baseline); (family, swakv / target, above clairv.)
    for seed, d, f, lay, p in cells:
        sw = by[(seed, d, f, lay, p, "swakv")]
        ceil = by[(seed, d, f, lay, None, "ceiling")]["hit_rate"]
        vals = [by.get((seed, d, f, lay, p, s), {}).get("hit_rate") for s in base]
        best = max((v for v in vals if v is not None), default=None)
        cl = by.get((seed, d, f, lay, p, "clairvoyant"), {}).get("hit_rate")
        floor = sw.get("floor", {})
        line = ((f"{seed:>10}" if several else "") + f"{d:>4} {f:<9}{lay:<8}{sw['window'] or '-':>5}{p:>8}{_fmt(ceil)}"
                + "".join(_fmt(v, 12) for v in vals) + _fmt(sw.get("hit_rate")))
        ratio = None
        if best is not None and sw.get("hit_rate") is not None:
            ratio = sw["hit_rate"] / best if best else (math.inf if sw["hit_rate"] else 1.0)
        line += f"{ratio:>8.2f}x" if ratio is not None else f"{'-':>9}"
        line += _fmt(cl) + _fmt(sw.get("bound"), 7) + (f"{floor.get('lru_share', 0):>7.2f}" if floor else f"{'-':>7}")
        print(line)
        if sw.get("hit_rate") is None or best is None:
            errors.append(f"{name(seed, d)} {f}/{lay}/{p}: {sw.get('error') or 'no baseline'}")
            continue
        n_a += 1
        margins.append((f, sw["hit_rate"] - best))
        t = tally.setdefault((f, lay), [0, 0, 0, 0])
        t[0] += 1
        if sw["hit_rate"] < best - TOLERANCE:
            t[1] += 1
            winner = by[(seed, d, f, lay, p, base[vals.index(best)])]
            computed = ""
            if sw.get("computed") and winner.get("computed"):
                more = sw["computed"] / winner["computed"] - 1
                fewer_computed += more < 0
                computed = f"   computed {abs(more):.1%} {'more' if more >= 0 else 'fewer'} tokens in all"
            where = _against_lru(sw.get("floor"))
            if where:
                lost_where[where[0]] = lost_where.get(where[0], 0) + 1
                computed += where[1]
            losing.append(f"{name(seed, d)} {f}/{lay}/{p}: swakv {sw['hit_rate']:.3f} < {best:.3f} - {TOLERANCE}"
                          + computed)
        if f in GOAL_FAMILIES and p in sorted(pools_of[(seed, d, f, lay)])[:2]:
            target = min(1.10 * best, ceil)
            goals.append((f, sw["hit_rate"] / target if target else 1.0, cl is not None and target > cl + 1e-9))
            t[2] += 1
            if sw["hit_rate"] >= target - 1e-9:
                goal_b += 1
                t[3] += 1
            else:
                ub = sw.get("bound")
                short_b.append((f"{name(seed, d)} {f}/{lay}/{p}: {sw['hit_rate']:.3f} < {target:.3f}"
                                + (f"   clairv.* {cl:.3f}" if cl is not None else "")
                                + (f"   bound {ub:.3f}" if ub is not None else ""),
                                None if cl is None else target > cl + 1e-9,
                                None if ub is None else target > ub + 1e-9))
        if cl is not None:
            gaps.setdefault(f, []).append((cl - sw["hit_rate"], cl - best))
    n_b = goal_b + len(short_b)
    bl = " / ".join(names[s] for s in base)
    print(f"\ncells losing to the better of {bl} by more than {TOLERANCE}: {len(losing)} of {n_a}")
    for x in losing:
        print("  " + x)
    if losing:
        print(f"  of these, {fewer_computed} computed fewer tokens in all than that column: the hit rate counts "
              "first admissions only, while a preempted request's recomputation (through the cache) is in the "
              "total")
    if lost_where:
        behind = lost_where.get("behind", 0) + lost_where.get("written off", 0)
        print(f"  of these, {behind} trail the floor's reference LRU on swakv's own admissions by more than "
              f"{TOLERANCE} of the prompt tokens ({lost_where.get('written off', 0)} of them half or more by "
              f"write-offs: the tiers came back on evidence and lost again; the rest by the bank and the overshoot), "
              f"{lost_where.get('schedule', 0)} do not (they lose to LRU's run on its own schedule)")
    print(f"every cell >= the better of {bl} - {TOLERANCE}: {n_a - len(losing)} of {n_a}")
    print(f"two tightest pools, {', '.join(GOAL_FAMILIES)}: >= min(1.10 x the better, the ceiling): {goal_b} of {n_b}")
    for x, _, _ in short_b:
        print("  " + x)
    above_cl = [a for _, a, _ in short_b if a is not None]
    above_ub = [a for _, _, a in short_b if a is not None]
    print(f"  of these misses, target above the clairvoyant heuristic (not a bound): {sum(above_cl)} of "
          f"{len(above_cl)} with one (single-group)")
    print(f"  of these misses, target above the bound on swakv's own schedule (retention_bound: no policy "
          f"with that schedule reaches it): {sum(above_ub)} of {len(above_ub)} with one (full attention, hybrid)")
    if several:
        print("\nby family and layout, over every seed: losing cells / cells; two tightest pools' targets met / "
              "targets")
        print(f"  {'':<9}" + "".join(f"{lay:>16}" for lay in lays if any(k[1] == lay for k in tally)))
        for f in fam:
            if any(k[0] == f for k in tally):
                print(f"  {f:<9}" + "".join(
                    f"{f'{t[1]}/{t[0]}' + (f'; {t[3]}/{t[2]}' if t[2] else ''):>16}"
                    for lay in lays if any(k[1] == lay for k in tally)
                    for t in [tally.get((f, lay), [0, 0, 0, 0])]))
    if errors:
        print(f"cells that did not run: {len(errors)}")
        for x in errors:
            print("  " + x)
    if "sim:lru" in systems and "vllm-dense" in systems:
        pairs = [(by[k[:5] + ("sim:lru",)], by[k[:5] + ("vllm-dense",)]) for k in by if k[5] == "vllm-dense"
                 and k[:5] + ("sim:lru",) in by]
        same = sum(a.get("hit_tokens") == b.get("hit_tokens") for a, b in pairs)
        print(f"\nsimulated LRU (retention_sim.Lru) equals vLLM dense, hit token for hit token, in {same} of "
              f"{len(pairs)} cells")
    if gaps:
        print("\ngap to the clairvoyant heuristic (not an upper bound; negative: above it; single-group layouts; "
              "hit-rate points, mean / max over cells): "
              f"swakv, the better of {bl}")
        for f, g in gaps.items():
            print(f"  {f:<9} swakv {sum(a for a, _ in g) / len(g):>6.3f} / {max(a for a, _ in g):>6.3f}"
                  f"   {bl} {sum(b for _, b in g) / len(g):>6.3f} / {max(b for _, b in g):>6.3f}   ({len(g)} cells)")
    if plot:
        plot_standing(margins, goals, plot, f"seed {', '.join(map(str, seeds))}; against the better of {bl}")
        print(f"\nplot: {plot}")
    return dict(cells=n_a, losing=len(losing), goal_b=goal_b, n_b=n_b)


def plot_standing(margins: list, goals: list, path: str, title: str) -> tuple[list, list]:
    """The two counts of the issue as a picture, one strip of cells per family: every cell's margin over the
    better baseline (hit-rate points; the losing cells are those under the tolerance line), and each tight-pool
    goal cell's hit rate over its target (hollow where the target is above the clairvoyant heuristic). Returns
    the two series, sorted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    jitter = random.Random(0)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw=dict(width_ratios=(7, 3)))
    panels = ((left, [(f, m, False) for f, m in margins], list(FAMILIES), lambda v: v < -TOLERANCE, -TOLERANCE),
              (right, goals, list(GOAL_FAMILIES), lambda v: v < 1 - 1e-9, 1.0))
    for ax, points, fams, short, line in panels:      # points: (family, value, hollow)
        for i, f in enumerate(fams):
            mine, colour = [p for p in points if p[0] == f], f"C{list(FAMILIES).index(f)}"
            for hollow in (False, True):
                ys = [v for _, v, h in mine if h == hollow]
                xs = [i + jitter.uniform(-0.35, 0.35) for _ in ys]
                ax.scatter(xs, [max(y, 0.01) if ax is right else y for y in ys], s=7, linewidths=0.6,
                           facecolors="none" if hollow else colour, edgecolors=colour)
            ax.annotate(f"{sum(short(p[1]) for p in mine)} of {len(mine)}", (i, 0), xycoords=("data", "axes fraction"),
                        xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
        ax.axhline(line, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(fams)), fams)
        ax.grid(alpha=0.3, axis="y")
    losing = sum(m < -TOLERANCE for _, m in margins)
    left.set_yscale("symlog", linthresh=0.01)
    left.set(ylabel="swakv - the better baseline (hit rate, symlog)",
             title=f"every cell: {len(margins) - losing} of {len(margins)} >= the better - {TOLERANCE} "
                   "(counts: cells under the line)")
    met = sum(g >= 1 - 1e-9 for _, g, _ in goals)
    right.set_yscale("log")
    right.set(ylabel="swakv / min(1.10 x the better, the ceiling) (log, 0.01 at least)",
              title=f"two tightest pools: {met} of {len(goals)} met\n(hollow: target above the clairvoyant heuristic)")
    right.title.set_fontsize(10)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return sorted(m for _, m in margins), sorted(g for _, g, _ in goals)


# -- the best any eviction policy can do, on tiny instances ----------------------------------------
TINY_BLOCK, TINY_WINDOW, TINY_STEP, TINY_RUNNING = 4, 8, 16, 2
TINY = {   # three workloads' shapes, scaled down so that every eviction choice can be tried
    "chat": lambda seed: chat(seed, sessions=2, turns=3, first=(6, 10), message=(2, 4), answer=(1, 3)),
    "siblings": lambda seed: siblings(seed, prompts=2, requests=5, system=(8, 12), question=(1, 3), answer=(1, 2)),
    "agent": lambda seed: agent(seed, sessions=2, turns=3, system=8, task=(1, 3), tool=(2, 6), answer=(1, 2)),
}
TINY_POOLS = (4, 5, 6)


def exhaustive_best(workload: Workload, windows, num_blocks: int, max_nodes: int = 20_000) -> dict:
    """The most hit tokens any eviction policy reaches on this trace with the serving loop (tiny scale):
    a depth-first search over every choice of which live cached block to evict (branch and bound: a
    branch is cut when even full hits for every request not yet admitted could not beat the best)."""
    runs = []      # (rid, tokens of prompt + answer, longest possible hit)
    for si, (sess, turn_prompts) in enumerate(zip(workload.sessions, workload.prompts())):
        for t, (turn, prompt) in enumerate(zip(sess.turns, turn_prompts)):
            runs.append((f"s{si}t{t}", prompt + list(turn.output), (len(prompt) - 1) // TINY_BLOCK * TINY_BLOCK))
    chains = {rid: set(chain_hashes(tokens, TINY_BLOCK)) for rid, tokens, _ in runs}
    max_hit = {rid: m for rid, _, m in runs}

    def attempt(choices):
        finished: set[str] = set()
        live_cache: list = [None]

        def live():
            if live_cache[0] is None:
                live_cache[0] = set().union(*(c for rid, c in chains.items() if rid not in finished))
            return live_cache[0]
        full = frozenset(g for g, w in enumerate(windows) if w is None)
        adapter = SimAdapter(windows, num_blocks, Scripted(choices, live, full), block_size=TINY_BLOCK)
        timeline = Timeline()
        free, admitted = adapter.free, set()
        adapter.free = lambda req: (finished.add(req.request_id), live_cache.__setitem__(0, None), free(req))
        admit = adapter.admitted
        adapter.admitted = lambda req, hit, index: (index >= 0 and admitted.add(req.request_id),
                                                    admit(req, hit, index))
        try:
            stats = serve(workload, adapter, step_tokens=TINY_STEP, max_running=TINY_RUNNING, timeline=timeline)
            if full:     # every complete run against the bound on its own schedule
                over[0] = max(over[0], stats["hit_tokens"] - hit_token_bound(
                    timeline, num_blocks - 1, TINY_BLOCK, [w for w in windows if w]))
            return stats["hit_tokens"], stats["prompt_tokens"], None, None
        except Branch as b:
            bound = adapter.hit_tokens + sum(m for rid, m in max_hit.items() if rid not in admitted)
            return None, None, b.n, bound

    over = [-math.inf]        # most hit tokens a complete run got above the bound on its own schedule
    best, prompt_tokens, nodes, stack = -1, 0, 0, [[]]
    while stack:
        choices = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise RuntimeError(f"more than {max_nodes} runs: instance too large for an exhaustive search")
        hits, total, n, bound = attempt(choices)
        if hits is not None:
            if hits > best:
                best, prompt_tokens = hits, total
        elif bound > best:
            stack.extend(choices + [i] for i in range(n - 1, -1, -1))
    return {"hit_tokens": best, "prompt_tokens": prompt_tokens, "hit_rate": best / prompt_tokens, "runs": nodes,
            "over_bound": over[0] if over[0] > -math.inf else None}


def run_oracle(seeds: int) -> list[dict]:
    """Tiny instances: the exhaustive best next to the ceiling, swakv and simulated LRU."""
    rows = []
    kw = dict(step_tokens=TINY_STEP, max_running=TINY_RUNNING)
    for w in TINY:
        for lay in SINGLE_GROUP + ("hybrid",):
            windows = windows_of(lay, TINY_WINDOW)
            for seed in range(seeds):
                workload = TINY[w](seed)
                ceiling = serve(workload, SimAdapter(windows, None, block_size=TINY_BLOCK), **kw)
                for pool in TINY_POOLS:
                    num_blocks = pool * len(windows) + 1
                    row = dict(workload=w, layout=lay, seed=seed, pool_per_group=pool, ceiling=ceiling["hit_rate"])
                    try:
                        row["best"] = exhaustive_best(workload, windows, num_blocks)["hit_rate"]
                    except RuntimeError as exc:      # a single request that never fits, or too many runs
                        row["best"] = None
                        row["note"] = str(exc)
                    for name in ("swakv", "lru"):
                        adapter = (SwakvAdapter(windows, num_blocks, block_size=TINY_BLOCK) if name == "swakv" else
                                   SimAdapter(windows, num_blocks, "lru", block_size=TINY_BLOCK))
                        try:
                            row[name] = serve(workload, adapter, **kw)["hit_rate"]
                        except RuntimeError:
                            row[name] = None
                    rows.append(row)
    print(f"\nexhaustive best over every eviction choice, tiny instances (block {TINY_BLOCK}, W {TINY_WINDOW}, "
          f"{TINY_RUNNING} running, {TINY_STEP} tokens a step); hit tokens / prompt tokens")
    print(f"{'workload':<9}{'layout':<9}{'seed':>5}{'blocks':>7}{'ceiling':>9}{'best':>8}{'swakv':>8}{'lru':>8}")
    for r in rows:
        print(f"{r['workload']:<9}{r['layout']:<9}{r['seed']:>5}{r['pool_per_group']:>7}{_fmt(r['ceiling'])}"
              f"{_fmt(r['best'], 8)}{_fmt(r['swakv'], 8)}{_fmt(r['lru'], 8)}")
    done = [r for r in rows if None not in (r["best"], r["swakv"], r["lru"])]
    print(f"\n{len(done)} instances searched to the end; mean hit rate, instances at the exhaustive best, and "
          "against lru: below / above")
    print(f"{'best':<8}{sum(r['best'] for r in done) / max(1, len(done)):>7.3f}{len(done):>5}")
    for s in ("swakv", "lru"):
        print(f"{s:<8}{sum(r[s] for r in done) / max(1, len(done)):>7.3f}"
              f"{sum(abs(r[s] - r['best']) < 1e-9 for r in done):>5}"
              f"{sum(r[s] < r['lru'] - 1e-9 for r in done):>5}{sum(r[s] > r['lru'] + 1e-9 for r in done):>5}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", type=lambda s: s.split(","), default=list(FAMILIES))
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS))
    ap.add_argument("--draws", type=int, default=3, help="settings drawn at random (default 3)")
    ap.add_argument("--seed", type=int, default=None, help="replay the draws of this seed (default: a fresh one)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (each imports vLLM once)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM columns even if importable")
    ap.add_argument("--lru", action="store_true", help="add the simulated LRU even when vLLM runs")
    ap.add_argument("--draw", type=int, default=None, help="run only this draw (0-based) of the seed's draws")
    ap.add_argument("--systems", type=lambda s: s.split(","), default=None,
                    help=f"run only these of {', '.join(SYSTEMS)} (the ceiling always runs)")
    ap.add_argument("--unseen", action="store_true", help="draw settings outside the grid's (UNSEEN) and each "
                    "family's own shape (sessions, turns, documents, popularity, lengths): workloads nobody tuned for")
    ap.add_argument("--jsonl", help="write one JSON line per run here")
    ap.add_argument("--report-from", help="only print the report of earlier --jsonl files (comma-separated; a "
                    "later file's run replaces an earlier one's of the same cell and system)")
    ap.add_argument("--plot", help="also draw the report's two counts to this PNG (every cell's margin over the "
                    "better baseline; the tight-pool goal cells against their targets)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--oracle", action="store_true", help="instead of the grid: tiny instances, the best any "
                    "eviction policy reaches (exhaustive search) next to swakv and LRU")
    ap.add_argument("--oracle-seeds", type=int, default=3, help="tiny instances per workload and layout")
    args = ap.parse_args()
    for name, chosen, known in (("family", args.families, FAMILIES), ("layout", args.layouts, LAYOUTS)):
        bad = [c for c in chosen if c not in known]
        if bad:
            ap.error(f"unknown {name}(s) {bad}; known: {', '.join(known)}")
    if args.draws < 1 or args.jobs < 1:
        ap.error("--draws and --jobs must be >= 1")
    if args.draw is not None and not 0 <= args.draw < args.draws:
        ap.error(f"--draw must be in 0..{args.draws - 1}")
    bad = [s for s in args.systems or () if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s) {bad}; known: {', '.join(SYSTEMS)}")
    if args.plot:
        if args.oracle:
            ap.error("--plot draws the grid's report; --oracle prints no such report")
        if importlib.util.find_spec("matplotlib") is None:
            ap.error("--plot needs matplotlib (pip install matplotlib, or run with the main interpreter)")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            ap.error(f"--plot: no directory {os.path.dirname(os.path.abspath(args.plot))!r}")
    t0 = time.time()
    if args.oracle:
        rows = run_oracle(args.oracle_seeds)
        if args.jsonl:
            with open(args.jsonl, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"\n{len(rows)} instances in {time.time() - t0:.0f} s")
        return
    if args.report_from:
        merged: dict = {}
        for path in args.report_from.split(","):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        r = json.loads(line)
                        merged[(r.get("seed"), r.get("unseen"), r["draw"], r["family"], r["layout"], r["pool_per_group"],
                                r["system"])] = r
        report(list(merged.values()), args.plot)
        return
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    print(f"seed {args.seed}", file=sys.stderr)
    rows = run_grid(args)
    report(rows, args.plot)
    print(f"\n{len(rows)} runs in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
