"""The floor under the retention policy: shadows of plain LRU, and the credit that decides whose order the
free queue follows.

The tiers (``free_queue``) guess where hits will land; plain LRU is what an operator expects at least, in
either of the two forms vLLM 0.33 offers for sliding windows: **dense** (every freed cached block waits in
release order) and **sparse** (its default retention: a sliding group's window is kept only where a hit can
land, at prompt ends and junctions; the other dropped windows never wait at all). Neither wins everywhere:
with more sessions than the pool holds the dropped interiors push dense LRU's chains out (edit sliding 1894,
seed 127399297: dense 0.188, sparse 0.617), while an edit that cuts a history anywhere hits interiors only
dense keeps (edit sliding 3049, seed 133950997: 0.746 against 0.660). ``Floor`` replays both from the hashes
alone: a ``Shadow`` holds the ``(group, hash)`` a pool of the same size would still hold free had it evicted
in that LRU order (``sparse`` exists where a group drops blocks, and never holds what tier 1 is for: dropped
windows below no fork, no prompt end and no last message). The dense one is vLLM dense to the token on 10 of
the 11 schedules checked; the sparse one is swakv's model of vLLM's rule, not the rule: it also holds a
request's end window and its last message's windows, which vLLM 0.33 never caches, and served swakv's own
schedule vLLM sem. hit twice what it counts on one edit trace (docs/retention-rounds.md, forty-third round).
Both pools hold the same blocks for running requests, so an LRU's free cached blocks fit in the units the real
pool's free cached blocks take (``trim``). Every lookup is also run against each shadow and those held blocks,
so at each admission ``i`` the manager knows the hit it granted, ``h_i``, and each LRU's, ``d_i`` and ``s_i``
(with ``P_i`` tokens looked up). The **reference** starts dense and changes only on a pool's worth of evidence: with
``lead_i = clamp(lead_{i-1} + s_i - d_i, +-cap)``, it turns sparse once the lead reaches ``+cap``, dense
again once it reaches ``-cap`` (changing at every sign of the lead, the floor followed the sparse LRU after
the loss of a single prompt and traded as many losing cells in as out: docs/retention-rounds.md,
eighteenth round). ``l_i`` is the reference's hit at admission ``i`` (chosen before it). Then

    credit_i = min(bank_i, credit_{i-1} + h_i - l_i + SLACK * P_i),   credit_0 = 0,
    bank_i = min(cap, SURPLUS * (P_1 + ... + P_i))      (what is above the bank waits in reserve, below)

and the free queue follows the tiers while ``credit >= 0``, the reference's order otherwise (``free_queue``:
content that LRU does not hold goes first, so the real free blocks become its own at once). Below zero the
real pool hits as LRU does, so the credit cannot see the tiers doing better. What it can see, from the hashes
alone, is where the tiers' order would have parted from LRU's on these same admissions (ARC's ghost hits): LRU
**missing** a chain its own order evicted which the tiers' order would have kept (tier-3 ghosts evicted
while following LRU, in one run from a lookup's hit end: the blocks by which that hit would have been
longer; looked up while tier 3's votes say keep old chains), and LRU **hitting** a free block
the tiers' order would have evicted by then: a tier-1 or tier-2 block once more cached units were evicted
since it was freed than waited ahead of it in its tier and the ones before; while those votes say
youngest-first, a tier-3 chain once more were evicted since its release than were released after it (a
proven batch: plus what tier 3 held then, as it goes after every chain; a quick chain, which goes after
the others, is counted as an ordinary one: sooner than its order would reach it, which only lowers the
evidence). Counting every hit on a block the
tiers' order merely ranks first held rag traces on LRU for good (docs/design.md, Retention). The
``evidence`` adds the first (tokens) and subtracts the second, from the switch on, never below ``-cap``
(as the credit never rises above ``cap``: a phase where LRU was right is not held against the tiers for
good, so a later phase where LRU thrashes still brings them back); once it covers the deficit, the deficit
is written off (``forgiven``) and the tiers get another try. Each write-off doubles the evidence the next one
needs (``backoff``: so many times the deficit), until the tiers fill the bank again: tries that keep losing
come back ever more rarely, as a sender backs off after each collision. Where LRU never misses
what it evicted, the tiers never come back. (An earlier rule, "LRU served fewer hit tokens in as many
admissions as the tiers' last stretch", almost never fired where hit rates grow over a trace: zipf
sessions warming up kept the floor on LRU for good after one transient dip, 0.595 against the tiers'
0.706 alone; docs/design.md, Retention.)

The **bank** is what the tiers may lose to LRU after a winning stretch before it takes over: a loss shows
only once an admission needs what they evicted, so the floor acts only once the bank is spent. A pool's
worth of tokens is a large share of a trace a few pools long (edit sliding 3177 of seed 382353997, W 1024,
looks up 7.8 pools' worth in all: a pool's worth is 12.8% of its prompt tokens), so the bank is also at
most ``SURPLUS`` of the tokens looked up so far. A surplus beyond it waits in **reserve** (bank and reserve
together a pool's worth at most). Once the bank is spent, LRU's order runs until the real pool has evicted
as many tokens as the exposure held (what LRU held free and the real pool lacked then), and the reserve then
comes back: a dip costs the tiers a stretch in LRU's order, not their surplus, while a trace's last turns,
which the tiers lose and do not win back, are served in LRU's order. Without the reserve (the surplus
beyond the bank dropped), an early dip held the tiers in LRU's order for good where they win most
(siblings sliding 191 of seed 328134681: 0.830 -> 0.345); with a bank of 0.5% or 1%, early dips did the
same to edit sliding cells (docs/retention-rounds.md, forty-first round).

A **streak** hands the order to LRU sooner, for a while. The credit is long memory, and a loss shows only
once an admission needs what the tiers evicted: where their guesses turn wrong all at once (an edit or phase
trace's sessions moving on together) a surplus lets them lose it and more before LRU takes over. So ``STREAK``
admissions in a row served by the tiers' order that hit less than both LRUs (a win over the reference resets
the count; a loss to the reference alone is its lag, the lead's business), while the credit is below the
**exposure** (``exposed``, from the free queue: the tokens of content the reference holds free and the real
pool does not, about the most the tiers can still lose to it), set the credit to -1 and hold the rest back.
It is given back at the tiers' next win over the reference, or once the real pool has evicted as many tokens
as were exposed (by then what LRU held and the real pool did not has been reused or lost either way),
whichever comes first; until then LRU's order follows unless the evidence writes the deficit off. A passing
dip costs the tiers a few admissions in LRU's order, not their surplus: holding it back for good, for a whole
pool's turnover or until a win alone lost phase and rag cells of the unseen grid that the tiers were winning
(docs/retention-rounds.md, thirty-sixth and thirty-seventh rounds).

**The bound.** The bank moves a surplus into the reserve, whose limit only lowers it, and the reserve and a
streak give back no more than they held, so summing gives, after any ``n`` admissions,

    sum h_i >= sum l_i - SLACK * sum P_i - forgiven - overshoot_n,      overshoot_n = max(0, -credit_n)

and each write-off is at most the evidence of its stretch, which is at most the positive part of it (the
floor at ``-cap`` only drops negative evidence), so ``forgiven`` is at most the tokens LRU itself missed,
while in charge, on chains its own order had evicted and the tiers' would have kept (less what it hit that
the tiers' order would have evicted since the evidence last stood at ``-cap``): the manager trails LRU by
more than the slack and the current overshoot only by what LRU provably lost to its own evictions. The
backoff tightens that: the ``k``-th write-off since the tiers last filled the bank is at most ``E_k / 2^(k-1)``,
``E_k`` its stretch's evidence, so between two fills the write-offs sum to at most twice the largest ``E_k``,
however many tries the evidence grants. Over
a stretch of admissions from ``s`` on, the surplus carried into it more (credit, reserve and what a streak
held back: at most a pool's worth, spent once, not forever). Of it, only the bank, at most ``SURPLUS`` of the
tokens looked up before the stretch, is spent before LRU takes over; the reserve comes back only after LRU's
order has run for a turnover of what the real pool lacked. The credit only falls below zero at the admission
that crosses it (at most that admission's loss, its prompt at worst) and while the real pool still lacks
what the tiers evicted before the switch and LRU kept: that content leaves the shadow within one turnover
of the free pool. The comparison is with LRU on the same admissions (same order, same running requests),
not with another run.

Against the better of the two LRUs the reference costs a bounded amount: over a stretch where sparse is
the reference, ``lead`` starts at ``+cap`` and ends above ``-cap`` less the difference at the admission that
ends it, and clamping at ``+cap`` only discards the sparse LRU's gains, so ``sum (d_i - s_i)`` over the
stretch is at most ``2 cap`` plus that difference (alike for dense stretches, whose first starts at 0). So
``sum l_i >= max(sum d_i, sum s_i) - 2 cap (changes + 1) - changed_by``, ``changed_by`` the sum of
``|s_j - d_j|`` at the admissions where the reference changed, and the bound above holds against the
better LRU less that.
The overshoot's size is not bounded in advance: a loss is seen only when an admission needs what the tiers
evicted earlier.

O(1) per block: an ordered-dict operation per shadow per block freed, taken or revived, and per block a
shadow evicts; a comparison per block a hit takes back; a shadow holds at most one entry per free pool unit.
A lookup runs the hit search once more per shadow once either pool has evicted a cached block (before that
all hold everything).
"""
from __future__ import annotations

from collections import OrderedDict, deque

SLACK = 0.002        # the hit rate (share of prompt tokens) the tiers may lose to LRU before it takes over
SURPLUS = 0.02       # the share of the tokens looked up so far the credit may bank (the rest: in reserve)
STREAK = 3           # admissions in a row lost to both LRUs that hand the order to LRU while the credit is short


class Shadow:
    """What a pool of the same size would hold free had it evicted in plain LRU order, oldest first: an entry
    per free copy of a ``(group, hash)``. A content is computed again while an old copy of it waits where a
    hit could not use it (a sliding hit needs the whole window below its end), and each copy takes a block
    of LRU's pool until LRU evicts that copy; the content leaves with its last one."""

    __slots__ = ("blocks", "copies", "units", "ignore", "on_leave", "_serial")

    def __init__(self):
        # a free copy's units: ``(group, hash)`` names one copy of a content, ``(group, hash, n)`` any other
        self.blocks: OrderedDict[tuple, int] = OrderedDict()
        self.copies: dict[tuple[int, bytes], deque] = {}    # a content's other free copies, oldest first
        self.units = 0              # units its copies take
        self.ignore: OrderedDict[tuple[int, bytes], None] = OrderedDict()   # frees this LRU would not see
        self.on_leave = lambda key: None   # told each key that leaves it
        self._serial = 0

    def __contains__(self, key: tuple[int, bytes]) -> bool:
        return key in self.blocks or (bool(self.copies) and key in self.copies)

    def freed(self, key: tuple[int, bytes], units: int) -> bool:
        """A cached block no one holds any more joins the back; False if this LRU's pool never held it."""
        if self.ignore and self.ignore.pop(key, 0) is None:
            return False
        blocks = self.blocks
        if key in blocks or key in self.copies:     # another copy of content already free
            self._serial += 1
            blocks[key + (self._serial,)] = units
            self.copies.setdefault(key, deque()).append(self._serial)
        else:
            blocks[key] = units
        self.units += units
        return True

    def taken(self, key: tuple[int, bytes]) -> None:
        """A hit took a copy back (the oldest): this LRU's pool holds it; other free copies stay."""
        units = self.blocks.pop(key, 0)
        if not units:
            serials = self.copies.get(key)
            if not serials:
                return
            units = self.blocks.pop(key + (serials.popleft(),))
            if not serials:
                del self.copies[key]
        self.units -= units
        if key not in self.copies and key not in self.blocks:
            self.on_leave(key)

    def skip(self, key: tuple[int, bytes], cap: int) -> None:
        """The real pool will compute and free this block, this LRU's would not (its hit was longer)."""
        ignore = self.ignore
        ignore[key] = None
        if len(ignore) > cap:
            ignore.popitem(last=False)

    def trim(self, capacity: int) -> bool:
        """Both pools hold the same blocks for running requests, so this LRU's free cached blocks fit in the
        units the real pool's free cached blocks take: the front goes until they do. True if any went."""
        blocks, copies = self.blocks, self.copies
        gone = self.units > capacity
        while self.units > capacity:
            entry, units = blocks.popitem(last=False)
            self.units -= units
            if len(entry) == 3:         # the oldest of a content's other copies
                key = entry[:2]
                serials = copies[key]
                serials.popleft()
                if serials:
                    continue
                del copies[key]
                if key in blocks:
                    continue
            elif entry in copies:
                continue
            else:
                key = entry
            self.on_leave(key)
        return gone

    def reset(self) -> None:
        self.blocks.clear()
        self.copies.clear()
        self.ignore.clear()
        self.units = 0


class Floor:
    __slots__ = ("dense", "sparse", "lead", "credit", "cap", "slack", "surplus", "follow_lru", "evicted",
                 "admissions", "lru_admissions", "switches", "hits", "lru_hits", "prompt_tokens", "lowest",
                 "evidence", "block", "forgiven", "sparse_admissions", "changes", "changed_by",
                 "dense_hits", "sparse_hits", "on_sparse", "streak", "streaks", "held_back", "give_back_at",
                 "exposed", "evicted_tokens", "reserve", "give_back_on_win", "backoff")

    def __init__(self, cap: int = 0, slack: float = SLACK, surplus: float | None = None):
        self.dense = Shadow()       # plain LRU over every cached block freed
        self.sparse: Shadow | None = None   # plain LRU over all but windows no hit is known to end above
        self.lead = 0               # tokens the sparse LRU hit more than the dense one, within +-cap
        self.on_sparse = False      # the reference is the sparse LRU (since the lead last reached +cap)
        self.cap = cap
        self.slack = slack
        self.surplus = SURPLUS if surplus is None else surplus
        self.credit = 0.0
        self.follow_lru = False
        self.evicted = False        # either pool evicted a cached block (else both hold every hash)
        self.admissions = self.lru_admissions = self.switches = self.sparse_admissions = 0
        self.hits = self.lru_hits = self.prompt_tokens = 0
        self.lowest = 0.0
        self.evidence = 0               # below the floor: tokens the tiers' order would have served more
        self.block = 16                 # tokens a block (the smallest block size)
        self.forgiven = 0.0             # credit written off to give the tiers another try
        self.changes = 0                # admissions at which the reference changed
        self.changed_by = 0             # the sum of |s_j - d_j| over them (what the reference may cost)
        self.dense_hits = self.sparse_hits = 0   # each LRU's hits, summed
        self.streak = 0                 # admissions in a row the tiers' order lost to both LRUs
        self.streaks = 0                # times a streak handed the order to LRU
        self.held_back = 0.0            # the credit the last streak set aside
        self.give_back_at = None        # ... until a win or the real pool's evicted tokens reach this
        self.give_back_on_win = True    # ... whether a win gives it back (a streak's: yes; the bank's: no)
        self.reserve = 0.0              # surplus beyond the bank, given back after the bank is spent
        self.backoff = 1                # a write-off needs this many times the deficit in evidence
        self.exposed = lambda: 0        # the free queue's: tokens the reference holds free, the real pool not
        self.evicted_tokens = lambda: 0     # the free queue's: tokens of cached content evicted so far

    @property
    def reference(self) -> Shadow:
        """The LRU the credit is measured against and the free queue follows below zero."""
        return self.sparse if self.on_sparse else self.dense

    def taken(self, key: tuple[int, bytes]) -> None:
        self.dense.taken(key)
        if self.sparse is not None:
            self.sparse.taken(key)

    def trim(self, capacity: int) -> None:
        if self.dense.trim(capacity):
            self.evicted = True
        if self.sparse is not None and self.sparse.trim(capacity):
            self.evicted = True

    def reset(self) -> None:
        self.dense.reset()
        if self.sparse is not None:
            self.sparse.reset()
        self.evicted = False

    # -- the credit ------------------------------------------------------------------------------
    def admitted(self, hit: int, lru_hit: int, prompt_tokens: int, sparse_hit: int = -1) -> None:
        """An admission: the hit granted, each LRU's (``sparse_hit``: -1 without a sparse LRU), the tokens
        looked up. Decides whose order comes next."""
        if self.on_sparse:
            self.sparse_admissions += 1
            ref = sparse_hit
        else:
            ref = lru_hit
        self.dense_hits += lru_hit
        if sparse_hit >= 0:
            self.sparse_hits += sparse_hit
            lead = self.lead = max(-self.cap, min(self.cap, self.lead + sparse_hit - lru_hit))
            if self.cap and (lead == self.cap if not self.on_sparse else lead == -self.cap):
                self.on_sparse = not self.on_sparse
                self.changes += 1
                self.changed_by += abs(sparse_hit - lru_hit)
        self.admissions += 1
        self.lru_admissions += self.follow_lru
        self.hits += hit
        self.lru_hits += ref
        self.prompt_tokens += prompt_tokens
        bank = self.bank()
        credit = self._deposit(self.credit + hit - ref + self.slack * prompt_tokens, bank)
        if credit < self.lowest:
            self.lowest = credit
        if self.follow_lru and credit < 0 and self.evidence >= -credit * self.backoff:
            self.forgiven -= credit     # the tiers would have made up the deficit: another try
            credit = 0.0
            self.backoff *= 2           # ... and the next one, unless they fill the bank first, needs twice the proof
        elif credit >= bank > 0:
            self.backoff = 1
        if self.give_back_at is not None and ((hit > ref and self.give_back_on_win)
                                              or self.evicted_tokens() >= self.give_back_at):
            credit = self._deposit(credit + self.held_back, bank)
            self.give_back_at = None
        if hit > ref or self.follow_lru:
            self.streak = 0
        elif hit < (ref if sparse_hit < 0 else min(lru_hit, sparse_hit)):
            self.streak += 1
            if self.streak >= STREAK and 0 <= credit < (exposed := self.exposed()):
                self.held_back = credit + 1         # a turn of the workload: LRU's order for a while
                self.give_back_at = self.evicted_tokens() + exposed
                self.give_back_on_win = True
                credit = -1.0
                self.streak = 0
                self.streaks += 1
        if credit < 0 and self.reserve > 0 and self.give_back_at is None:
            self.held_back, self.reserve = self.reserve, 0.0    # the bank spent: LRU's order until the real
            self.give_back_at = self.evicted_tokens() + self.exposed()  # pool has turned over what it lacks
            self.give_back_on_win = False
        self.credit = credit
        follow = credit < 0
        if follow != self.follow_lru:
            self.evidence = 0
            self.follow_lru = follow
            self.switches += 1

    def _deposit(self, credit: float, bank: float) -> float:
        """``credit`` within the bank; what is above it waits in reserve (the two together a pool's worth)."""
        if credit > bank:
            self.reserve += credit - bank
            credit = bank
        self.reserve = min(self.reserve, self.cap - bank)
        return credit

    def bank(self) -> float:
        """``bank_i``, the most credit the tiers may hold now: a pool's worth of tokens, and at most ``surplus``
        of the tokens looked up so far (spent before LRU takes over, it costs at most that share of a trace)."""
        return min(self.cap, self.surplus * self.prompt_tokens)

    def tiers_vs_lru(self, blocks: int) -> None:
        """Below the floor: the tiers' order would have served ``blocks`` more blocks' tokens than LRU did
        (fewer, if negative); the evidence stays at or above ``-cap``."""
        self.evidence = max(-self.cap, self.evidence + blocks * self.block)

    def report(self) -> dict:
        return {"admissions": self.admissions, "lru_share": self.lru_admissions / max(1, self.admissions),
                "switches": self.switches, "hits": self.hits, "lru_hits": self.lru_hits,
                "prompt_tokens": self.prompt_tokens, "credit": round(self.credit), "lowest": round(self.lowest),
                "forgiven": round(self.forgiven), "sparse_share": self.sparse_admissions / max(1, self.admissions),
                "changes": self.changes, "changed_by": self.changed_by, "streaks": self.streaks}
