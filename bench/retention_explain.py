"""Why one cell of the retention grid wins or loses against plain LRU: the floor's account, tier 3's order,
and which evictions cost the hits LRU's pool would have served.

`bench/retention.py` says *that* a cell loses; this says *where*. It serves one cell as the grid does, with
a ``Trace`` attached to swakv's manager, and prints:

- the hit rate next to the simulated LRU's on its own schedule, and the hit tokens the floor counts next to
  its reference's (LRU's hits on swakv's schedule) and those of twins served that schedule exactly, all in
  swakv's one run (``SameSchedule``; a twin whose pool runs short there drops out): the simulated LRU
  (where the shadow and it differ, the shadow is off; where it and LRU's own run differ, the schedule is,
  and the floor cannot see that part of the gap), vLLM 0.33's dense and sem. managers where vLLM is
  importable (the sparse shadow is swakv's model of vLLM sem., not vLLM's rule), and swakv's tiers alone
  (its floor switched off, ``tiers_alone``): swakv's hits less theirs are what the floor did on this cell,
  lost or won (on 73 losing cells of both grids it lost on 19: docs/retention-rounds.md, forty-fourth
  round). The hit rate counts first admissions; the floor counts every admission, so where requests are
  preempted swakv can lead its shadow and still trail LRU's hit rate;
- the floor's account: write-offs, the credit at the end, the share of admissions it followed LRU; its
  stated bound's terms (``bound_terms``), and swakv's gap to the better vLLM column on its schedule split in
  two (``parts``): that column over the floor's reference (what the shadows miss), the reference over
  swakv (what the floor let go: slack, write-offs, overshoot, less the margin);
- a timeline every ``--every`` admissions: hit tokens minus the shadow's so far, the credit, the order
  in force (the tiers with tier 3 in LRU order, or by count on full attention, youngest-first, or LRU below
  the floor);
- when tier 3 turned youngest-first and back, and which votes did it;
- the cached blocks evicted, by where each waited and the order in force then;
- every admission where the shadow's LRU hit was longer: its lost tokens, shared among the blocks LRU's
  hit used that the real pool lacked, by where each waited when it was evicted and the order in force
  then; "never evicted here" marks content the real pool never held then (LRU computed it again after a
  shorter hit of its own, and kept it);
- both hit rates at pools up to ``--nearby`` percent smaller and larger: plain LRU can jump by several
  points within a fraction of a percent of the pool (a working set that just fits or just does not), and
  there a tiny change in the order of frees moves its shadow by as much, so a loss at one pool size alone
  is a knife edge, a loss at every size a bias (edit sliding 3177, seed 382353997: LRU 0.660 at 3147
  blocks, 0.719 at 3157).

    python bench/retention_explain.py --seed 541911745 --draw 2 --family edit --layout gemma3 --pool 4293

``--cells FILE`` does the accounting alone for many cells (the grid's losers, say), one row each.

It reads the free queue's private state (``kvmanager/free_queue.py``), as a debugger would;
tests/test_retention_explain.py keeps it in step.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvmanager.floor import Floor  # noqa: E402
from kvmanager.free_queue import ANSWER, THRESHOLD, FreeQueue  # noqa: E402

NEVER = "never evicted here"
VOTES = {("remove", True): "hits on tier-3 batches older than tier 3 holds",
         ("note_lookup", True): "ghosts LRU's order evicted",
         ("note_lookup", False): "ghosts youngest-first evicted that LRU would have kept",
         ("recomputed", True): "ghosts LRU's order evicted, computed again where no lookup reached them",
         ("recomputed", False): "ghosts youngest-first evicted that LRU would have kept, computed again"}


class Trace:
    """Records one manager's admissions, evictions, tier-3 votes and lost blocks while attached (a context
    manager: it wraps ``FreeQueue`` and ``Floor`` methods for that manager's instances only, and restores
    them on exit)."""

    def __init__(self, mgr):
        self.queue = mgr.pool.free
        self.admissions: list[tuple[int, int, float, str]] = []   # (hit, LRU's, credit, order after)
        self.evicted: dict[tuple[int, bytes], str] = {}           # content -> where it waited, order then
        self.lost_blocks: Counter = Counter()                     # where the blocks LRU used had gone
        self.lost_tokens: Counter = Counter()
        self.flips: list[tuple[int, str]] = []
        self.evictions: Counter = Counter()                       # cached blocks evicted, by where, order
        self.votes: Counter = Counter()
        self.first_eviction = 0                                   # the admission that evicted first
        self._pending: list[str] = []                             # this admission's lacking blocks
        self._saved: list = []
        self._lru_before = 0

    def order(self) -> str:
        q = self.queue
        if q.floor.follow_lru:
            return "LRU below the floor" if q.floor.reference is q.floor.dense else "sparse LRU below the floor"
        if q._frequency_first():        # it ranks tier 3 whatever the release order is
            return "tiers, tier 3 by count"
        return "youngest-first" if q._votes >= THRESHOLD else "tiers"

    def _where(self, entry) -> str:
        q, b = self.queue, entry.bin
        if b.batches is None:
            if entry.claim == ANSWER:
                return "tier 2 (an answer)"
            return {1: "tier 1 (unreachable)", 2: "tier 2 (speculative)"}.get(q._tiers.index(b), "tier 0")
        return {id(q._chains): "tier-3 chain", id(q._quick): "tier-3 quick chain"}.get(id(b.batches),
                                                                                      "tier-3 proven")

    # -- the wrappers ----------------------------------------------------------------------------
    def __enter__(self) -> Trace:
        trace, queue, floor = self, self.queue, self.queue.floor

        def wrap(cls, name, before=None, after=None):
            original = getattr(cls, name)

            def method(obj, *args, **kwargs):
                mine = obj is queue or obj is floor
                if mine and before:
                    before(*args)
                out = original(obj, *args, **kwargs)
                if mine and after:
                    after(*args)
                return out
            self._saved.append((cls, name, original))
            setattr(cls, name, method)

        def compared(*_):
            trace._lru_before = floor.lru_hits

        def admitted(hit, *_):       # LRU's hit: the one the credit compared with (``floor.reference``)
            trace._settle()
            trace.admissions.append((hit, floor.lru_hits - trace._lru_before, floor.credit, trace.order()))

        def popped(entry, _bin):
            if entry.block_hash is not None:
                if not trace.evicted:
                    trace.first_eviction = len(trace.admissions)
                where = f"{trace._where(entry)}, {trace.order()}"
                trace.evicted[(entry.group, entry.block_hash)] = where
                trace.evictions[where] += 1

        def lost(key):
            copies = queue._cached[key[0]].get(key[1]) if queue._cached else None
            if not copies:
                trace._pending.append(trace.evicted.get(key, NEVER))

        def voted(v):
            before = queue._votes >= THRESHOLD
            caller = sys._getframe(2).f_code.co_name
            if caller == "_passed":         # ghosts met again: by a lookup's walk or computed again
                caller = sys._getframe(3).f_code.co_name
            trace.votes[VOTES.get((caller, v > 0), f"{caller} {v:+d}")] += 1
            trace._flip_from = before

        def voted_after(v):
            now = queue._votes >= THRESHOLD
            if now != trace._flip_from:
                trace.flips.append((len(trace.admissions), "youngest-first" if now else "LRU order"))

        def back_to_lru():
            if queue._votes >= THRESHOLD:
                trace.flips.append((len(trace.admissions), "LRU order (an admission got less than LRU)"))

        wrap(Floor, "admitted", before=compared, after=admitted)
        wrap(FreeQueue, "_pop", before=popped)
        wrap(FreeQueue, "lost_block", before=lost)
        wrap(FreeQueue, "_vote", before=voted, after=voted_after)
        wrap(FreeQueue, "lost_to_lru", before=back_to_lru)
        return self

    def __exit__(self, *exc) -> None:
        self._settle()
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()

    def _settle(self) -> None:
        """Charge the last admission's lost tokens to where its lacking blocks had gone, in shares."""
        if self._pending and self.admissions:
            hit, lru_hit = self.admissions[-1][:2]
            for where, n in Counter(self._pending).items():
                self.lost_blocks[where] += n
                self.lost_tokens[where] += (lru_hit - hit) * n / len(self._pending)
        self._pending = []


class SameSchedule:
    """swakv's adapter with ``twins`` (name -> manager: plain LRU, vLLM's, swakv's tiers alone) served the same
    schedule, all in one run: each request admitted, preempted and finished when swakv's is. Where a twin's
    hit is shorter it computes the difference within the admission's step; longer, it waits for swakv's
    request to catch up. A twin whose pool runs short on that schedule drops out (its hits: None); the others
    go on. Plain LRU's hits there are what the floor's shadow estimates without a second pool: where the two
    differ the shadow is off, where this and LRU's own run differ the schedule is."""

    def __init__(self, swakv, twins: dict):
        self.swakv, self.twins = swakv, dict(twins)
        self.hits: dict[str, int | None] = dict.fromkeys(self.twins, 0)   # at every admission (the floor's count)
        self._requests: dict = {}       # swakv's request -> {twin: the twin's}
        self._found: dict = {}          # each twin's lookup for the request being admitted

    def _live(self, req):
        return [(name, self.twins[name], twin) for name, twin in self._requests[id(req)].items()
                if self.hits[name] is not None]

    def request(self, rid: str, prompt):
        req = self.swakv.request(rid, prompt)
        self._requests[id(req)] = {name: t.request(rid, prompt) for name, t in self.twins.items()
                                   if self.hits[name] is not None}
        return req

    def lookup(self, req):
        self._found = {name: t.lookup(twin) for name, t, twin in self._live(req)}
        return self.swakv.lookup(req)

    def allocate(self, req, n: int, hit: int = 0, blocks=None) -> bool:
        if not self.swakv.allocate(req, n, hit, blocks):
            return False
        for name, t, twin in self._live(req):
            if blocks is not None:          # an admission: the twin takes its own hit
                twin_blocks, twin_hit = self._found[name]
                ok = t.allocate(twin, max(0, hit + n - twin_hit), twin_hit, twin_blocks)
                twin.num_computed_tokens += twin_hit
                self.hits[name] += twin_hit
            else:
                behind = req.num_computed_tokens + n - twin.num_computed_tokens
                ok = behind <= 0 or t.allocate(twin, behind)
            if not ok:
                self.hits[name] = None      # its pool ran short on swakv's schedule: it drops out
        return True

    def admitted(self, req, hit: int, index: int) -> None:
        self.swakv.admitted(req, hit, index)

    def advance(self, req, n: int) -> None:
        self.swakv.advance(req, n)
        for _, _, twin in self._live(req):
            twin.num_computed_tokens = max(twin.num_computed_tokens, req.num_computed_tokens)

    def append(self, req, token: int) -> None:
        self.swakv.append(req, token)
        for _, t, twin in self._live(req):
            t.append(twin, token)

    def preempt(self, req) -> None:
        self.swakv.preempt(req)
        for _, t, twin in self._live(req):
            t.preempt(twin)

    def free(self, req) -> None:
        self.swakv.free(req)
        for _, t, twin in self._live(req):
            t.free(twin)
        del self._requests[id(req)]


class _NoFloor(Floor):
    """A floor that counts and never acts: its free queue follows the tiers throughout."""
    __slots__ = ()

    def admitted(self, hit: int, lru_hit: int, prompt_tokens: int, sparse_hit: int = -1) -> None:
        self.admissions += 1
        self.hits += hit
        self.prompt_tokens += prompt_tokens


def tiers_alone(windows, layout: str, num_blocks: int):
    """swakv's adapter with its floor switched off (as a debugger would: the floor's class swapped)."""
    import retention as R
    adapter = R.SwakvAdapter(windows, num_blocks, units=R.UNITS.get(layout))
    adapter.mgr.pool.free.floor.__class__ = _NoFloor
    return adapter


@functools.cache
def _vllm_adapter_class():
    """retention's, looked up once (``--cells`` builds twins per cell; where vLLM is missing, it says so once)."""
    import retention as R
    return R.vllm_adapter_class()


def twins(windows, layout: str, num_blocks: int) -> dict:
    """Every twin ``explain`` serves swakv's schedule: the simulated LRU (vLLM dense's order), vLLM 0.33's dense
    and sem. managers where vLLM is importable (the sparse shadow is swakv's model of vLLM sem., not vLLM's
    rule: vLLM caches a sliding block only in the window below a prompt's replay boundary or a junction),
    and swakv's tiers alone: swakv's hits less theirs are what the floor did on the cell."""
    import retention as R
    out = {"LRU": R.SimAdapter(windows, num_blocks, "lru")}
    vllm = _vllm_adapter_class()
    if vllm is not None:
        out["vLLM dense"] = vllm(windows, num_blocks, semantic=False)
        out["vLLM sem."] = vllm(windows, num_blocks, semantic=True)
    out["tiers alone"] = tiers_alone(windows, layout, num_blocks)
    return out


def _tokens(hits: int | None) -> str:
    return "ran short" if hits is None else f"{hits:,}"


def bound_terms(floor) -> dict:
    """The floor's stated bound at the end of a run (``kvmanager/floor.py``), in tokens at every admission:
    ``hits >= reference - slack - forgiven - overshoot``; ``margin`` is by how much it held."""
    slack = floor.slack * floor.prompt_tokens
    overshoot = max(0.0, -floor.credit)
    return {"hits": floor.hits, "reference_hits": floor.lru_hits, "slack": slack, "forgiven": floor.forgiven,
            "overshoot": overshoot,
            "margin": floor.hits - (floor.lru_hits - slack - floor.forgiven - overshoot)}


def nearby(workload, windows, layout: str, pool: int, percent: float, kw: dict) -> list[tuple[int, float, float]]:
    """``(pool, LRU's hit rate, swakv's)`` at nine pools spread evenly over ``pool`` +- ``percent`` %."""
    import retention as R
    step = max(1, round(pool * percent / 400))
    rows = []
    for p in range(pool - 4 * step, pool + 4 * step + 1, step):
        if p < 1:
            continue
        num_blocks = p * len(windows) + 1
        try:
            swakv = R.serve(workload, R.SwakvAdapter(windows, num_blocks, units=R.UNITS.get(layout)), **kw)
            lru = R.serve(workload, R.SimAdapter(windows, num_blocks, "lru"), **kw)
        except RuntimeError:        # a request that fits nowhere in a pool this small
            continue
        rows.append((p, lru["hit_rate"], swakv["hit_rate"]))
    return rows


def serve_alike(seed: int, draw: int, family: str, layout: str, pool: int, unseen: bool = False,
                traced: bool = True):
    """Serve one cell of the grid as it does, every twin on swakv's schedule in the same run (swakv traced
    unless ``traced`` is False: ``--cells`` reads no timeline and need not pay for the wrapped methods):
    ``(settings, workload, serve's keywords, swakv's stats, its floor, the SameSchedule, the Trace or None)``."""
    import retention as R
    d = R.draw_settings(seed, draw + 1, unseen)[draw]
    workload, _ = R.workload_of(d, family)
    windows = R.windows_of(layout, d.window)
    kw = dict(step_tokens=d.chunk, max_running=d.concurrency)
    num_blocks = pool * len(windows) + 1
    swakv = R.SwakvAdapter(windows, num_blocks, units=R.UNITS.get(layout))
    try:
        with Trace(swakv.mgr) if traced else contextlib.nullcontext() as trace:
            alike = SameSchedule(swakv, twins(windows, layout, num_blocks))
            stats = R.serve(workload, alike, **kw)
    except RuntimeError as exc:             # a request that fits nowhere: say which pools the grid runs
        ceiling = R.SimAdapter(windows, None)
        R.serve(workload, ceiling, **kw)
        sizes = R.pool_sizes(workload, layout, windows, d.concurrency, len(ceiling.mgr.blocks) - 1)
        raise SystemExit(f"{pool} blocks per group is too small for this cell ({exc}); the grid's pools for "
                         f"it: {', '.join(map(str, sizes))}") from None
    return d, workload, kw, stats, swakv.mgr.pool.free.floor, alike, trace


def parts(floor, hits: dict) -> dict:
    """swakv's gap to the better vLLM column served its schedule (plain LRU where vLLM is not importable), in
    tokens at every admission, split in two: that column less the floor's reference (what the shadows miss of
    vLLM's rules, and the lag in choosing dense or sparse), and the reference less swakv (slack + forgiven +
    overshoot - margin: what the floor let go). The first two are None where every such twin ran short on
    swakv's schedule."""
    vllm = [hits[k] for k in ("vLLM dense", "vLLM sem.") if hits.get(k) is not None]
    better = max(vllm) if vllm else hits["LRU"]
    split = {"gap": None, "vllm_over_reference": None} if better is None else {
        "gap": better - floor.hits, "vllm_over_reference": better - floor.lru_hits}
    return {"better": better, **split, "reference_over_swakv": floor.lru_hits - floor.hits, **bound_terms(floor)}


def explain(seed: int, draw: int, family: str, layout: str, pool: int, every: int, unseen: bool = False,
            near: float = 1.0) -> None:
    import retention as R
    d, workload, kw, stats, floor, alike, trace = serve_alike(seed, draw, family, layout, pool, unseen)
    windows = R.windows_of(layout, d.window)
    lru = R.serve(workload, R.SimAdapter(windows, pool * len(windows) + 1, "lru"), **kw)
    hits = alike.hits
    print(f"seed {seed} draw {draw} (window {d.window}, {d.concurrency} running, chunk {d.chunk}): "
          f"{family} / {layout} / {pool} blocks per group, {stats['prompt_tokens']:,} prompt tokens at first "
          f"admissions, {floor.prompt_tokens:,} at every admission")
    print(f"hit rate: swakv {stats['hit_rate']:.4f}, plain LRU on its own schedule {lru['hit_rate']:.4f} "
          f"({stats['hit_rate'] - lru['hit_rate']:+.4f})")
    print(f"hit tokens at first admissions (the hit rate's): swakv {stats['hit_tokens']:,}; LRU on its own "
          f"schedule {lru['hit_tokens']:,}")
    print(f"hit tokens at every admission (the floor's account, re-admissions after preemption included): swakv "
          f"{floor.hits:,}; LRU on swakv's schedule: the floor's reference (its dense or sparse shadow, as it "
          f"chose admission by admission) {floor.lru_hits:,}, the simulated LRU (vLLM dense's order) served "
          f"exactly {_tokens(hits['LRU'])}")
    shadows = f"dense {floor.dense_hits:,}" + (f", sparse {floor.sparse_hits:,}" if floor.sparse is not None else "")
    if "vLLM dense" in hits:
        print(f"vLLM 0.33 served swakv's schedule: dense {_tokens(hits['vLLM dense'])}, sem. "
              f"{_tokens(hits['vLLM sem.'])}; the floor's shadows: {shadows}")
    else:
        print(f"the floor's shadows: {shadows} (vLLM 0.33 served the same schedule: run with "
              f"/tmp/vllm-venv/bin/python)")
    alone = hits["tiers alone"]
    print("swakv's tiers alone (its floor switched off) served that schedule: "
          + ("ran short" if alone is None else f"{alone:,} ({floor.hits - alone:+,}: what the floor did here)"))
    print(f"floor: written off {floor.forgiven:,.0f} tokens; credit at the end {floor.credit:,.0f} (lowest "
          f"{floor.lowest:,.0f}); followed LRU at {floor.lru_admissions}/{floor.admissions} admissions, "
          f"{floor.switches} switches")
    p, n = parts(floor, hits), floor.prompt_tokens
    print(f"the floor's bound: swakv {p['hits']:,} >= reference {p['reference_hits']:,} - slack {p['slack']:,.0f} - "
          f"written off {p['forgiven']:,.0f} - overshoot {p['overshoot']:,.0f}, by {round(p['margin']):,}")
    column = "vLLM column" if "vLLM dense" in hits else "LRU"
    if p["gap"] is None:
        print(f"swakv's gap to the better {column} on its schedule: none to take, every such twin ran short")
    else:
        print(f"swakv's gap to the better {column} on its schedule: {p['gap'] / n:+.4f} of the tokens looked up = "
              f"{p['vllm_over_reference'] / n:+.4f} (that column less the floor's reference) "
              f"{p['reference_over_swakv'] / n:+.4f} (the reference less swakv)")
    print(f"\n{'admission':>9} {'hits - shadow':>14} {'credit':>9}  order")
    total = 0
    for i, (hit, lru_hit, credit, order) in enumerate(trace.admissions, 1):
        total += hit - lru_hit
        if i % every == 0 or i == len(trace.admissions):
            print(f"{i:>9} {total:>14,} {credit:>9,.0f}  {order}")
    print(f"\nfirst cached block evicted after admission {trace.first_eviction}" if trace.evicted else
          "\nno cached block was evicted")
    flips = [f"{what} at {i}" for i, what in trace.flips]
    print("tier 3's order: " + (", ".join(flips[:6]) or "LRU throughout")
          + (f", and {len(flips) - 6} more changes up to admission {trace.flips[-1][0]}" if len(flips) > 6 else ""))
    print("votes: " + (", ".join(f"{n} {what}" for what, n in trace.votes.most_common()) or "none"))
    print("cached blocks evicted: " + (", ".join(f"{n} {where}" for where, n in trace.evictions.most_common())
                                       or "none"))
    lost = sum(trace.lost_tokens.values())
    print(f"\nwhere the shadow's LRU hit was longer ({lost:,.0f} tokens in all), by where the blocks it used "
          "had gone:")
    for where, tokens in trace.lost_tokens.most_common():
        print(f"  {tokens:>9,.0f} tokens  {trace.lost_blocks[where]:>6} blocks  {where}")
    if not trace.lost_tokens:
        print("  none")
    if near > 0:
        print(f"\nat nearby pools (+-{near:g}%), each on its own schedule:\n"
              f"{'pool':>7} {'LRU':>6} {'swakv':>6} {'difference':>10}")
        for p, lru_rate, rate in nearby(workload, windows, layout, pool, near, kw):
            print(f"{p:>7} {lru_rate:>6.3f} {rate:>6.3f} {rate - lru_rate:>+10.3f}")


def account(cells: list[tuple]) -> None:
    """One row per cell ``(seed, draw, family, layout, pool, unseen)``: swakv's gap to the better vLLM column
    served its schedule, split as ``parts`` splits it, and the floor's bound terms, in hit-rate points
    (tokens at every admission; "short": that twin ran short on swakv's schedule); the sums over every cell
    at the end (a short twin's part counted as 0)."""
    cols = ("gap", "vllm_over_reference", "reference_over_swakv", "slack", "forgiven", "overshoot", "margin")
    print("gap and vllm-ref against " + ("the better of vLLM 0.33 dense and sem." if _vllm_adapter_class() else
                                         "the simulated LRU (vLLM is not importable here)")
          + ", served swakv's schedule; hit-rate points of the tokens looked up at every admission")
    print(f"{'cell':<44} {'rate':>6} " + " ".join(f"{c:>8}" for c in ("gap", "vllm-ref", "ref-swakv", "slack",
                                                                       "forgiven", "oversh.", "margin", "floor did"))
          + "  switches")
    sums = dict.fromkeys(cols, 0.0)
    for seed, draw, family, layout, pool, unseen in cells:
        name = f"{seed} {draw} {family} {layout} {pool}" + (" unseen" if unseen else "")
        try:
            _, _, _, stats, floor, alike, _ = serve_alike(seed, draw, family, layout, pool, unseen, traced=False)
        except SystemExit as exc:
            print(f"{name:<44} {exc}")
            continue
        p, n, alone = parts(floor, alike.hits), floor.prompt_tokens, alike.hits["tiers alone"]
        for c in cols:
            sums[c] += (p[c] or 0) / n
        did = "   short" if alone is None else f"{(floor.hits - alone) / n:>+8.4f}"
        print(f"{name:<44} {stats['hit_rate']:>6.3f} "
              + " ".join("   short" if p[c] is None else f"{p[c] / n:>+8.4f}" for c in cols)
              + f" {did}  {floor.switches:>8}", flush=True)
    print(f"{'summed':<44} {'':>6} " + " ".join(f"{sums[c]:>+8.4f}" for c in cols))


def read_cells(path: str) -> list[tuple]:
    """``seed draw family layout pool [unseen]`` per line (``#`` comments), as the grid's losers print them."""
    import retention as R
    cells = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            words = line.split("#")[0].split()
            if not words:
                continue
            try:
                seed, draw, family, layout, pool = int(words[0]), int(words[1]), words[2], words[3], int(words[4])
                unseen = words[5:] == ["unseen"]
                if (family not in R.FAMILIES or layout not in R.LAYOUTS or words[5:] not in ([], ["unseen"])
                        or draw < 0 or pool < 1):
                    raise ValueError
            except (ValueError, IndexError):
                raise SystemExit(f"{path}:{number}: expected 'seed draw family layout pool [unseen]', got "
                                 f"{line.strip()!r}") from None
            cells.append((seed, draw, family, layout, pool, unseen))
    return cells


def main() -> None:
    import retention as R
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, help="the grid's seed")
    ap.add_argument("--draw", type=int, help="the draw (0-based)")
    ap.add_argument("--family", choices=list(R.FAMILIES))
    ap.add_argument("--layout", choices=list(R.LAYOUTS))
    ap.add_argument("--pool", type=int, help="blocks per group, as the grid prints them")
    ap.add_argument("--cells", help="instead of one cell: a file of cells ('seed draw family layout pool "
                    "[unseen]' per line), one row each: the gap to the better vLLM column in parts")
    ap.add_argument("--every", type=int, default=25, help="admissions between timeline rows (default 25)")
    ap.add_argument("--unseen", action="store_true", help="the seed's unseen draws (retention.py --unseen)")
    ap.add_argument("--nearby", type=float, default=1.0,
                    help="also both hit rates at nine pools within this many percent of --pool (0: not)")
    args = ap.parse_args()
    if args.cells:
        account(read_cells(args.cells))
        return
    if None in (args.seed, args.draw, args.family, args.layout, args.pool):
        ap.error("give --seed, --draw, --family, --layout and --pool (or --cells)")
    if args.draw < 0 or args.pool < 1 or args.every < 1 or not 0 <= args.nearby < 100:
        ap.error("--draw must be >= 0, --pool and --every >= 1, --nearby in [0, 100)")
    explain(args.seed, args.draw, args.family, args.layout, args.pool, args.every, args.unseen, args.nearby)


if __name__ == "__main__":
    main()
