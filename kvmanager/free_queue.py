"""The eviction policy, in one place: where a freed block waits, and which free blocks a new one is made of.

Free blocks keep their cached content until reused (lazy eviction), so the order in which they are reused
is the eviction order. A hit needs the blocks right below its end (all of them for full attention, the
last window for a sliding one), and hits end where a later request's chain stops agreeing with an earlier
one: the end of a finished request, a **fork** (two requests that shared a prefix, then diverged), a
resent prompt. So free blocks wait in tiers by where a hit can still land; a new block comes from the
lowest non-empty tier:

0. **empty**: blocks holding nothing (never filled, a partial last block, look-ahead slots, units left
   over from a dissolution). Evicting them costs nothing: no cached block goes while one is free.
1. **unreachable**: cached blocks a sliding (or chunked) group dropped mid-request that lie below no
   fork and no prompt end, and windows a follow-up already consumed (shared by a hit that extended the
   chain). No plausible hit ends above them: a claim about the workload, checked. Each block it is made
   for is marked; a hit that takes one back, or a lookup that LRU's pool (the floor's shadow) served with
   one tier 1 had evicted, counts against it. While more than one in ``DOUBT`` of the marked blocks were
   wanted again (edits and regenerations cut a history anywhere; retrieval reorders documents), such
   blocks wait in tier 3 in release order instead, as LRU's order has them: those dropped from then on, and
   at the withdrawal those it had filed in tier 1 before (each claim below lets go of its blocks alike).
2. **speculative**: dropped blocks in the window below the request's prompt end (an identical resend) or
   below any point of its last ``LAST_MESSAGE_TOKENS`` tokens: a later prompt that agrees with it up to its
   last message (another question on the same document, an edited last turn) forks there. Evicting them
   before every finished chain is a claim too (such forks are rarer than follow-ups), checked the same way:
   where it fails (questions over retrieved documents come back to a document's end), they wait in tier 3.
   What a later request **left** of a session's chain waits here too, while that claim holds: a lookup that
   leaves a remembered chain at a new fork (an edit's cut, a regenerated answer) marks the blocks of that
   chain above the fork that wait in a finished follow-up's chain (one whose session has come back before);
   the session goes on from the cut, so no hit ends above it again. It is checked as tier 2's claim is. A
   first turn's chain is left alone: a second session's first lookup at a shared system prompt's end is a
   new fork too, and its hashes cannot tell it from an edit.
   A finished request's **answer** (its blocks from the one its answer starts in: no resend of its prompt
   hits them, only a follow-up turn) waits here too while the answer claim holds: that follow-ups do not
   come (one-off questions after shared documents or system prompts). Unlike the tiers' claims it starts in doubt, since
   a follow-up only shows itself a session's turn later: an evicted answer no lookup wanted while two
   pools' worth of cached units were evicted after it counts for it, a lookup whose chain goes on through
   an evicted answer (or a hit on a free one) against it, and it holds while more than ``DOUBT`` times as
   many count for it as against.
3. **reusable**, in release batches: a finished request's **chain** (its trailing window, its full-attention
   blocks), which its follow-up turn needs; and, apart, blocks **proven** shared (below a fork of their
   chain, or of a preempted request, which comes back first). A window that is not a whole number of
   blocks reaches, from a hit at a request's end (a block boundary), up to a block further back than its
   last token did: the block a decoding request dropped last, which a hit at its end would need, waits
   here in release order while follow-ups come (the answer claim below is not holding), goes where the
   rest of its drop went at the request's next drop, and joins its chain when it finishes.

Tier 3's order adapts. Plain LRU is the worst order for the common cyclic reuse of sessions (a session's
next turn queues behind every other session's, so LRU evicts exactly the chain needed next), and the best
when reuse comes soon. It starts as LRU (the older front of chains and proven blocks goes first) and
learns from **ghosts**: the hashes of tier-3 blocks it evicted. A lookup that stops where a ghost chain goes on (or
a ghost's block computed again, where no lookup's walk reached it) votes for keeping old chains when LRU evicted it
and keeping them would have served it (a chain's distance to its release, in tier-3 units, was within the horizon
below: past it youngest-first lets a chain go first too, so a Zipf tail that every order misses casts no vote;
proven blocks age out only past the longest distance, so theirs always vote), and against it when youngest-first
evicted it although LRU would have kept it (the distance was within what tier 3 holds). A hit on a chain older than
every free unit (plain LRU, all free units its own, would have let it go by now) votes for keeping old chains too: a
forecast, which agent loops need before their first turnover. Counted against every free unit, empty ones included,
it waits for pressure; counted against tier 3 alone (which hot sessions' hits keep small, while tiers 1 and 2 and
the empty units hold the rest of LRU's reach) it held zipf and phase traces youngest-first where LRU still hit.
Only after ``THRESHOLD`` net votes (a saturating counter) it evicts the **youngest** chain first, except that
anything older than the horizon goes first: chains nobody came back for still age out. The horizon is the
keep-time that serves most of the latest reuse distances (``_horizon``: youngest-first serves about V / H of the
reuses within a horizon H, V what tier 3 can hold); proven blocks, reused by any request at any distance, age out
only past the longest. A chain whose session has **ended** goes first too: a request whose
hit took back a finished chain knows its session's gap (that chain's age), and its own chain, once ``LATE``
times that old, was its session's last while the ended-session claim holds (returns of such chains came
within ``LATE`` times their gap at least ``DOUBT`` times as often as later, plus one, in doubt until then:
agent loops come back late after long tool calls; and at most one in ``DOUBT`` of the overdue chains met came
back: a Zipf user's cold session returns at any time). A **quick** chain (one with a block whose last hit from tier 3
came within what tier 3 held then: LRU's order would have served that reuse too; or a block of a hash
whose ghost, evicted youngest first, a lookup passed within that reach: the same reuse, missed; such hashes
are remembered as ghosts are) then goes after the other chains, the quick ones youngest first as well: youngest-first
protects the long tail of a cyclic or Zipf reuse, and a hot session's chain, which comes back before tier
3 turns over, is what it would evict first. Proven blocks then go last. In LRU order, chains and proven
blocks are merged by release; **chains first** (still LRU among each) once lookups missed more proven
blocks that the merged order evicted while a chain waited than chains-first would have cost chains' reuses
(a chain hit after more proven units were evicted than chain units waited ahead of it; a chain it evicted,
missed, weighs two): where chains never come back (one-off questions after shared documents or system
prompts) they make room for what does.

**Full attention: the frequency order** (``frequency.FrequencyOrder``: how many later prompts contained each
hash, the order of magnitude of that count, then the deepest block, then the oldest). Where every group needs
the whole prefix, tier 3 may evict in that order instead of by release. While follow-ups have not shown (the
answer claim, tier 2 above, is not refuted) it does, whatever tier 3's own order: a chain no request extends is
worth the prompts that contain it, not its release. Otherwise ghosts tell the two apart: a lookup missing a
block the release order evicted while a lower magnitude waited votes for the frequency order; one missing a
block the frequency order evicted that the release order would still hold (within tier 3's volume), two
against; it acts while the votes are positive (they start at 0) and tier 3 is not youngest-first. A layout
with windows (sliding, chunked) uses it only before follow-ups show, and only while more recently finished
requests' chains fit their windows than not (``note_fit``, a saturating count): such a chain keeps every
block from the first, so a hit at any depth needs every block below it, as with full attention. A longer
chain keeps only its trailing window, whose deepest blocks serve the only hit it can give; the ghosts' duel
on such layouts lost zipf sessions and chats (docs/retention-rounds.md, twenty-sixth round).

Forks are learnt from hashes alone, for sliding-only models too: where blocks are cached the first child
of every parent hash is remembered, and a lookup follows the remembered chain past its hit; where the
request's chain leaves it, that parent is a fork. Every memory (children, forks, ghosts) is bounded by
twice the pool's size.

**The floor** (``floor``): these tiers are guesses, and plain LRU is what an operator expects at least. Every
free entry holding a hash also waits in plain LRU order, in one of two bins per shadow of plain LRU the floor
keeps (dense, vLLM 0.33's every-block cache; sparse, where a group drops blocks: no window tier 1 is for):
content that shadow also holds, and content it does not. While the floor's credit is negative (the tiers' hits
fell more than its slack below its reference LRU's on the same trace) a new block comes from the empty tier,
then the content the reference does not hold, then its own order: the free blocks become that LRU's at once,
rather than after a pool's turnover of recomputed blocks pushing out what it kept. An admission that got less
than dense LRU would have also ends tier 3's youngest-first order: keeping old chains is the guess such a hit
proves wrong. Below the floor, lookups passing ghosts LRU's order evicted and hits on blocks the tiers' order
would have evicted by then (``due``: counted in cached units evicted) tell the floor where the two orders
would have parted (its evidence for giving the tiers another try). Ghosts are passed along the remembered
chain and, past a fork, along the request's own: a session's chain behind a shared system prompt leaves the
remembered one at the prompt's end. A ghost no walk reached votes when its block is computed again
(``recomputed``): a sliding session's evicted window behind a history no order kept. Not a block a running
request dropped below no fork (an edit's cut computes those again: tier 1's claim failing, not a follow-up
LRU thrashed).

Pool units and composites (see ``block_pool``): a block of a group of width ``k > 1`` is a composite of
``k`` units. Each tier (or batch) holds loose units (never used, left over, or width-1 groups' blocks)
and free composites per kind. For a block of kind ``g``, the bins are visited in eviction order: in the
first bin that holds a free composite of ``g``, it is reused as is (no composition, so deltas stay one id
per entry) unless ``k`` loose units wait in front of it; else, once the bins visited hold ``k`` units,
every entry of the lower bins, then loose units, then other kinds' composites of the last bin (frontmost
first, dissolved) compose it. So a dissolution across kinds still takes from the lowest tier. With width-1
groups only, this is one order and exactly the policy above.
"""
from __future__ import annotations

from bisect import bisect_right, insort
from collections import OrderedDict, deque
from heapq import heapify, heappop, heappush

from .floor import Floor, Shadow
from .frequency import FrequencyOrder

EMPTY, UNREACHABLE, SPECULATIVE = 0, 1, 2
ANSWER = 3           # a claim, not a tier: a finished request's answer waits in tier 2 while it holds
LEFT = 4             # a claim, not a tier: a follow-up's chain above where a later request left it waits in tier 2

# How far below a prompt's end a later prompt's fork is plausible: a question or user message (docs/design.md,
# Retention, tier 2, has the measurement that chose it).
LAST_MESSAGE_TOKENS = 256

# Tiers 1 and 2 are claims about the workload (tier 1: no hit ends above those blocks; tier 2: fewer end there
# than on finished chains), each checked against hits: withdrawn while more than one in DOUBT of the blocks it
# was made for (about the last four pools' worth) were wanted again (docs/retention-rounds.md, thirteenth and
# fourteenth rounds).
DOUBT = 20

THRESHOLD = 4        # net votes before tier 3 evicts the youngest chain first
VOTE_CAP = 16        # the counter saturates: a change of workload turns it back within a few lookups
PENALTY = 2          # a ghost evicted youngest-first that LRU would have kept weighs two votes
DISTANCES = 16       # reuse distances kept for the horizon: the latest, as they grow with a session's history
VOTED = 64           # evicted batches remembered as having voted (by a walk or ``recomputed``)
# The ended-session claim: a session comes back within LATE times its last reuse gap or not at all, so a chain past
# that keep-time was its session's last (counted over about the latest RETURNS returns; thirty-ninth round)
LATE = 2
RETURNS = 128


class Bin:
    """Free entries of one tier or one release batch: loose units and composites per kind, each in order."""

    __slots__ = ("loose", "composites", "units", "stamp", "batches", "counted", "young", "due", "ahead",
                 "dropped", "gap")

    def __init__(self, widths: tuple[int, ...], stamp: int = 0, batches: OrderedDict | None = None):
        self.loose: OrderedDict[int, object] = OrderedDict()
        self.composites = [OrderedDict() if w > 1 else None for w in widths]
        self.units = 0
        self.stamp = stamp          # tier 3: the units ever released into tier 3, this batch included
        self.batches = batches      # tier 3: the batches it is one of (chains or proven); None for a tier
        self.counted = False        # tier 3: a hit on it was counted (once per batch)
        self.young = False          # tier 3: last visited youngest-first
        # tier 3, youngest first: it goes once ``due`` plus the units released after it were evicted (cached
        # units evicted when it was released; for proven blocks, plus tier 3's units then: they go last)
        self.due = 0
        # tier 3, a chain: proven units evicted by its release, plus the chain units then waiting ahead of it
        # (chains first would have evicted it once more proven units than that went)
        self.ahead = 0
        self.dropped = False        # tier 3: blocks a running request dropped below no fork (``add_dropped``)
        self.gap = 0                # tier 3, a chain: its session's last reuse gap, in tier-3 units (0: unknown)

    def entries(self) -> list:
        out = list(self.loose.values())
        for q in self.composites:
            if q:
                out += q.values()
        return sorted(out, key=lambda b: b.order)


class FreeQueue:
    """Free loose units and composites in tiers, their eviction order, and what it learns from hits."""

    def __init__(self, units: list, widths: tuple[int, ...], last_message_tokens: int = LAST_MESSAGE_TOKENS,
                 cached: list | None = None, cap_tokens: int = 0):
        self.widths = widths
        # An entry's units by its kind, read instead of len(entry.units) (a freed block's tuple is cold memory
        # by then): a loose unit's kind is -1, so it reads the last item, 1.
        self._units_of_kind = (*widths, 1)
        self.last_message_tokens = last_message_tokens
        self._tiers = [Bin(widths) for _ in range(3)]
        # Every free entry holding a hash also waits in plain LRU order, in one of two bins: content the
        # floor's shadow (plain LRU) also holds, and content it does not (``_lru_out``: evicted first below
        # the floor, so the real pool converges to LRU's at once instead of being flooded by recomputes).
        self._lru_in, self._lru_out = Bin(widths), Bin(widths)
        self._sparse_in = self._sparse_out = None      # the same for the sparse LRU (``watch_sparse``)
        self._cached = cached if cached is not None else []     # the pool's: (group, hash) -> blocks
        self.floor = Floor(cap_tokens)
        self.floor.dense.on_leave = self._left_dense
        self.floor.exposed = self._exposed
        self.floor.evicted_tokens = self._evicted_tokens
        self._chains: OrderedDict[int, Bin] = OrderedDict()   # release batches, oldest first
        self._quick: OrderedDict[int, Bin] = OrderedDict()    # chains whose last reuse LRU would have served
        self._proven: OrderedDict[int, Bin] = OrderedDict()
        self._back = 0
        self._front = 0
        self.num_free_units = 0
        self._reusable_units = 0      # units waiting in tier 3
        self._clock = 0               # units ever released into tier 3: a batch's age is clock - stamp
        self._evicted = 0             # cached units ever evicted (reused for new content), any tier
        # The claims (tiers 1 and 2, the answer and left-branch claims): blocks each was made for, and those
        # wanted again (a hit took one back, a lookup went on through an evicted answer, or LRU's pool served one
        # the tier had evicted: ``lost_block``); the evicted ones are remembered for that
        self._claimed = [0, 0, 0, 0, 0]  # per claim (1, 2; ANSWER: answers evicted and not wanted since; LEFT)
        self._wanted = [0, 0, 0, 0, 0]   # per claim: those wanted again
        self._held = [False, True, True, False, True]   # per claim, at its last check (the answer's in doubt)
        self._claim_gone: OrderedDict[tuple[int, bytes], int] = OrderedDict()   # evicted -> its claim
        self._answers_gone: OrderedDict[bytes, int] = OrderedDict()   # evicted answer -> cached units evicted then
        # Every memory below is bounded by twice the pool's size: ghosts then cover reuse distances up to
        # about twice what the pool holds, the range where keeping old chains can win (as ARC's ghost lists)
        self._cap = max(16, 2 * len(units))
        self._pool_units = len(units)
        self.children: OrderedDict[bytes, bytes] = OrderedDict()   # parent hash -> its first child seen
        self.forks: OrderedDict[bytes, None] = OrderedDict()       # parents seen with two children
        self._ghosts: OrderedDict[bytes, tuple] = OrderedDict()  # hash -> (stamp, youngest-first, evicted
        # while following LRU, chains-or-proven side, frequency side, dropped by a running request, its
        # session's gap, proven)
        self._distances: deque[int] = deque(maxlen=DISTANCES)
        self._horizon_for: tuple[int, int] | None = None   # (volume, horizon) since the last distance
        self._voted_batches: OrderedDict[int, None] = OrderedDict()  # stamps of the batches that voted
        self._votes = 0
        # The ended-session claim: the age of the last chain a hit took back (the coordinator reads it as the
        # request's gap); returns of chains of known gap, on time and late; overdue chains met (evicted, or hit
        # late) and those of them that came back; the stamps of overdue chains evicted (bounded as the ghosts);
        # the chains' deadlines (a heap of (stamp + LATE * gap, stamp, id, bin)) and those past it (stamp order)
        self.last_reuse = 0
        self._returns = [0, 0]
        self._overdue_counts = [0, 0]
        self._overdue_gone: OrderedDict[int, None] = OrderedDict()
        self._deadlines: list[tuple] = []
        self._overdue: list[tuple] = []
        # Ghosts evicted youngest first that a lookup passed within tier 3's volume (a reuse LRU would have
        # served, missed): a chain released holding one of these hashes is quick
        self._quick_again: OrderedDict[bytes, None] = OrderedDict()
        # The frequency order (one unit per block: ``frequency``, set by the coordinator), and its duel with
        # the release order, a saturating counter (starts in doubt, at 0); with windows (``windows``), whether
        # finished requests' chains fit them (+1) or not (-1), saturating too
        self.frequency = False
        self.windows = False
        self._fits = 0
        self._frequency_order = FrequencyOrder()
        self._frequency_votes = 0
        # Chains before proven blocks (while tier 3 is in LRU order): > 0 once lookups missed proven blocks
        # LRU's merged order evicted while chains waited more often than chains-first would have lost a
        # chain's reuse (a saturating counter, as ``_votes``)
        self._tails = 0
        self._chain_units = 0          # units waiting in chain batches (quick ones included)
        self._proven_evicted = 0       # proven units ever evicted
        self.fresh = False            # the last take's entries are loose units holding nothing
        # The units given here (never used): the empty tier's loose units, in this order, behind any pushed
        # to its front and ahead of any pushed to its back. They wait outside its dict, from ``_never_at``
        # on, so a block of k of them is one slice, not k dict deletions (``pop_empty_run``).
        empty = self._tiers[EMPTY]
        self._never = list(units)
        self._never_ids = [u.block_id for u in units]
        self._never_at = 0
        for unit in units:
            unit.order = self._back
            self._back += 1
            unit.bin = empty
        empty.units = self.num_free_units = len(units)

    def __len__(self) -> int:
        return self.num_free_units

    # -- where freed blocks go -----------------------------------------------------------------
    def add_dropped(self, blocks, first: int, below_fork, below_prompt_end, at_end: int = -1) -> None:
        """Blocks a running request dropped (out of its window), in table order from index ``first``; those
        no one else holds wait by where a hit could still end just above them: at a fork of the request's
        chain (their indices in ``below_fork``), at its prompt end (``below_prompt_end``) or at its own end
        should it finish now (index ``at_end``: what its follow-up needs, even if a hit had shared it, so
        kept with the chains unless the answer claim says follow-ups do not come; ``passed_end``), nowhere
        known."""
        proven = []
        doubted = []
        tiers = self._tiers
        trusted = self._holds(UNREACHABLE)
        hopeful = self._holds(SPECULATIVE)
        i = first
        for block in blocks:
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._push(block, tiers[EMPTY])
                elif i in below_fork:
                    proven.append(block)
                elif i == at_end and not self._holds(ANSWER):   # while follow-ups come: tier 3, in release
                    doubted.append(block)                       # order, until its request moves on
                else:                   # shared: a window consumed by a hit that extended the chain
                    tier = UNREACHABLE if block.shared or i not in below_prompt_end else SPECULATIVE
                    self._claim(block, tier)
                    if trusted if tier == UNREACHABLE else hopeful:
                        self._wait_in(block, tier)
                    else:                   # the claim is in doubt: tier 3, in release order
                        doubted.append(block)
            i += 1
        if doubted:
            self._release_batches(doubted, [], dropped=True)
        if proven:
            self._release_batches([], proven)
        self._lru_release(reversed(blocks))      # LRU: a drop releases from the window's edge backwards

    def passed_end(self, block, block_hash: bytes, below_prompt_end: bool) -> None:
        """A block ``add_dropped`` kept in tier 3 for a hit at its request's end (``at_end``), which the
        request's next drop has moved past: if it still waits there with that content, it moves to where
        the rest of its drop went (tier 2 if ``below_prompt_end``, else tier 1), while that claim holds."""
        if not self._waiting(block, block_hash) or block.bin.batches is None:
            return
        tier = SPECULATIVE if below_prompt_end else UNREACHABLE
        self._claim(block, tier)
        if self._holds(tier):
            self._detach(block)
            self._wait_in(block, tier)

    def _wait_in(self, block, tier: int) -> None:
        """Into tier 1 or 2, due once the cached units now waiting there and in tier 1 are evicted."""
        tiers = self._tiers
        block.due = self._evicted + tiers[UNREACHABLE].units + (tiers[SPECULATIVE].units if tier == SPECULATIVE else 0)
        self._push(block, tiers[tier])

    def _waiting(self, block, block_hash: bytes) -> bool:
        """Whether ``block`` still waits free with that content (a free entry keeps its bin once taken)."""
        b = block.bin
        return (not block.ref_cnt and block.block_hash == block_hash and b is not None
                and (b.loose if block.kind < 0 else b.composites[block.kind]).get(block.block_id) is block)

    def _holds(self, claim: int) -> bool:
        """Whether ``claim`` holds now (tiers 1 and 2: at most one in ``DOUBT`` of its blocks wanted again; the
        answer claim: more than ``DOUBT`` times as many counted for it as against). Withdrawn, it no longer
        covers the blocks it already sent to its tier either: they join tier 3 as one release batch, as they
        would be filed now (left in place, the first edits' prompt-end windows went before every chain long
        after tier 2's claim was withdrawn: edit sliding 1904, seed 2137125457, 0.551 against vLLM sem.'s
        0.616). Holding again, it takes back only blocks freed from then on: moved back at once, tier 3's
        blocks of the claim went first in a burst (docs/retention-rounds.md, seventeenth round)."""
        claimed, wanted = self._claimed[claim], self._wanted[claim]
        holds = wanted * DOUBT < claimed if claim == ANSWER else wanted * DOUBT <= claimed
        if holds != self._held[claim]:
            self._held[claim] = holds
            if not holds:
                tier = self._tiers[UNREACHABLE if claim == UNREACHABLE else SPECULATIVE]
                covered = [e for e in tier.entries() if e.claim == claim]
                for e in covered:
                    self._detach(e)
                if covered:
                    self._release_batches(covered, [], dropped=claim != ANSWER)
        return holds

    def _claim(self, block, tier: int) -> None:
        """``tier``'s claim is made for ``block``; its counts halve once they span four pools' worth."""
        block.claim = tier
        self._claimed[tier] += 1
        if self._claimed[tier] > 2 * self._cap:
            self._claimed[tier] //= 2
            self._wanted[tier] //= 2

    def _answer_gone(self, block_hash: bytes) -> None:
        """An answer was evicted. Those no lookup wanted while two pools' worth of cached units were evicted
        after them (or that the record's bound pushes out) count for the answer claim."""
        answers = self._answers_gone
        answers[block_hash] = self._evicted
        cap = self._cap
        oldest, at = next(iter(answers.items()))      # one at a time: each eviction resolves at most one
        if at + cap < self._evicted or len(answers) > cap:
            del answers[oldest]
            self._claimed[ANSWER] += 1
            if self._claimed[ANSWER] > 2 * cap:
                self._claimed[ANSWER] //= 2
                self._wanted[ANSWER] //= 2

    def lost_block(self, key: tuple[int, bytes]) -> None:
        """LRU's pool served this block and the real one no longer held it: if a claim's block was evicted (tier
        1's, 2's, an answer), that claim was wrong."""
        tier = self._claim_gone.pop(key, 0)
        if tier:
            copies = self._cached[key[0]].get(key[1]) if self._cached else None
            if not copies:          # (a copy cached again since: the real pool lacked nothing)
                self._wanted[tier] += 1

    def add_released(self, blocks, preempted: bool = False, ends=(), gap: int = 0) -> None:
        """``(block, proven)`` pairs of a finished (or preempted) request's tables no one else holds, group
        by group, each tail first (so the head of a shared prefix goes last). ``proven``: True below a fork;
        None for its answer (from the block its answer starts in, below no fork); False for the rest of its
        chain. ``ends``: ``(block, hash)`` of blocks it dropped that a hit at its end needs (``add_dropped``'s
        ``at_end``), free since: they join its chain (its proven blocks, if preempted) wherever they wait,
        so that the window goes as one. ``gap``: the request's (``last_reuse``), 0 if unknown; the chain goes
        first once LATE times that old, while the ended-session claim holds."""
        chain, proven = [], []
        tiers = self._tiers
        no_follow_ups = self._holds(ANSWER)
        for block, block_hash in ends:
            if (preempted or not no_follow_ups) and self._waiting(block, block_hash):
                self._detach(block)
                block.claim = 0
                (proven if preempted else chain).append(block)
        for block, below_fork in blocks:
            if block.block_hash is None:
                self._push(block, tiers[EMPTY])
            elif preempted or below_fork:
                proven.append(block)
            elif below_fork is None and not block.shared:
                block.claim = ANSWER
                if no_follow_ups:
                    self._wait_in(block, SPECULATIVE)
                else:
                    chain.append(block)
            else:
                chain.append(block)
        if chain or proven:
            self._release_batches(chain, proven, gap=gap)
        self._lru_release(block for block, _ in blocks)

    def add_leftover(self, units) -> None:
        """Units of a dissolved composite that a composition did not use: they hold nothing, so front."""
        empty = self._tiers[EMPTY]
        for unit in reversed(units):
            self._push(unit, empty, front=True)

    def remove(self, block, shadows: bool = True) -> None:
        """A prefix hit takes a free block back. A hit on a tier-3 batch teaches the reuse distance; one on
        a block a claim was made for (tier 1's, 2's, an answer's), that the claim was wrong."""
        b = block.bin
        if block.claim:
            self._wanted[block.claim] += 1
            block.claim = 0
        if b.batches is not None and not b.counted:
            b.counted = True
            age = self._clock - b.stamp
            if age > self.num_free_units:       # LRU, all free units its own, would have evicted it by now
                self._vote(1)
            if b.batches is not self._proven:
                self._reused_after(age)
                if b.gap:
                    self._returned(age, b.gap)
                    if age > LATE * b.gap:      # an overdue chain, back
                        self._count_overdue(1, 1)
        if b.batches is not None and b.batches is not self._proven:
            self.last_reuse = self._clock - b.stamp
        if b.batches is not None:
            block.quick = self._clock - b.stamp <= self._reusable_units
            if (b.batches is not self._proven and self._tails <= 0 and not b.young
                    and self._proven_evicted > b.ahead):
                b.ahead = 1 << 62             # once per batch: chains first would have evicted it by now
                self._tails = max(-VOTE_CAP, self._tails - PENALTY)
        if self.floor.follow_lru:           # LRU kept it; had the tiers' order evicted it by now?
            if b.batches is None:           # tiers 1, 2: once what waited ahead of it went
                due = block.due
            elif self._votes >= THRESHOLD:  # youngest first: once every chain released after it went
                due = b.due + self._clock - b.stamp
            else:
                due = None
            if due is not None and self._evicted > due:
                self.floor.tiers_vs_lru(-1)
        self._unlink(block)
        if block.block_hash is not None:
            if shadows:
                self.floor.taken((block.group, block.block_hash))
            self.floor.trim(self.lru_units)

    def watch_sparse(self) -> None:
        """A group drops blocks: the floor also shadows the LRU that never keeps what tier 1 is for."""
        if self.floor.sparse is None:
            self.floor.sparse = Shadow()
            self.floor.sparse.on_leave = self._left_sparse
            self._sparse_in, self._sparse_out = Bin(self.widths), Bin(self.widths)

    def _lru_release(self, blocks) -> None:
        """Freed blocks (those no one holds) join the LRU order and the floor's shadows, in release order;
        the sparse one never holds a dropped window below no fork and no prompt end (tier 1's)."""
        floor = self.floor
        dense, sparse = floor.dense, floor.sparse
        for block in blocks:
            if block.ref_cnt or block.block_hash is None:
                continue
            key, units = (block.group, block.block_hash), self._units_of_kind[block.kind]
            dense.freed(key, units)     # a free LRU would not see may still be content it holds (an old copy)
            self._lru_push(block, self._lru_in if key in dense else self._lru_out)
            if sparse is not None:
                if block.claim != UNREACHABLE:
                    sparse.freed(key, units)
                self._sparse_push(block, self._sparse_in if key in sparse else self._sparse_out)
        floor.trim(self.lru_units)

    @property
    def lru_units(self) -> int:
        return self._lru_in.units + self._lru_out.units

    def _lru_push(self, block, b: Bin) -> None:
        (b.loose if block.kind < 0 else b.composites[block.kind])[block.block_id] = block
        block.lru = b
        b.units += self._units_of_kind[block.kind]

    def _sparse_push(self, block, b: Bin) -> None:
        (b.loose if block.kind < 0 else b.composites[block.kind])[block.block_id] = block
        block.lru_sparse = b
        b.units += self._units_of_kind[block.kind]

    def _lru_unlink(self, block) -> None:
        b = block.lru
        del (b.loose if block.kind < 0 else b.composites[block.kind])[block.block_id]
        b.units -= self._units_of_kind[block.kind]
        block.lru = None

    def _sparse_unlink(self, block) -> None:
        b = block.lru_sparse
        del (b.loose if block.kind < 0 else b.composites[block.kind])[block.block_id]
        b.units -= self._units_of_kind[block.kind]
        block.lru_sparse = None

    def _exposed(self) -> int:
        """Tokens of content the floor's reference LRU holds free and the real pool does not: at most what the
        tiers can still lose to it before the real pool holds what LRU would."""
        floor = self.floor
        shadow, held = (floor.sparse, self._sparse_in) if floor.on_sparse else (floor.dense, self._lru_in)
        return self._tokens(shadow.units - held.units)

    def _evicted_tokens(self) -> int:
        return self._tokens(self._evicted)

    def _tokens(self, units: int) -> int:
        """Pool units in tokens of one request's tables, as the floor's cap counts them."""
        return units * self.floor.block // sum(self.widths)

    def _left_dense(self, key: tuple[int, bytes]) -> None:
        """Plain LRU no longer holds this content: the real free copies of it go out of its order."""
        for block in self._copies(key):
            if block.lru is self._lru_in:
                self._lru_unlink(block)
                self._lru_push(block, self._lru_out)

    def _left_sparse(self, key: tuple[int, bytes]) -> None:
        for block in self._copies(key):
            if block.lru_sparse is self._sparse_in:
                self._sparse_unlink(block)
                self._sparse_push(block, self._sparse_out)

    def _copies(self, key: tuple[int, bytes]):
        group, block_hash = key
        blocks = self._cached[group].get(block_hash) if self._cached else None
        return blocks.values() if blocks else ()

    # -- learning: forks and ghosts ------------------------------------------------------------
    def learn(self, parent: bytes, child: bytes) -> None:
        """A block of hash ``child`` after ``parent`` was cached: remember the first child, or a fork."""
        children = self.children
        first = children.get(parent)
        if first is None:
            children[parent] = child
            if len(children) > self._cap:
                children.popitem(last=False)
        elif first == child:
            children.move_to_end(parent)
        elif parent not in self.forks:
            self._fork(parent)

    def seen(self, block_hash: bytes) -> None:
        """A block of this hash was cached: the frequency order counts it from now on."""
        self._frequency_order.seen(block_hash, 2 * self._cap)

    def note_fit(self, fits: bool) -> None:
        """A request of a layout with windows finished: whether a hit at its chain's end still needs the
        chain's first block in every window (then a hit at any depth needs every block below it, as with
        full attention)."""
        self._fits = min(VOTE_CAP, self._fits + 1) if fits else max(-VOTE_CAP, self._fits - 1)

    def referenced(self, hashes) -> None:
        """An admission's prompt (its block hashes, in order): for the frequency order."""
        self._frequency_order.referenced(hashes)

    def note_lookup(self, hash_at, start: int, limit: int) -> None:
        """After a lookup that hit ``start`` blocks of a prompt with ``limit`` usable ones: follow the chain
        remembered past the hit. Where the request's chain leaves it, its parent is a fork; the deepest
        ghost passed (an evicted tier-3 block) votes on tier 3's order."""
        children, ghosts = self.children, self._ghosts
        j = max(start, 1)
        if j >= limit:
            return
        answers = self._answers_gone
        if answers:                     # the request goes on through answers evicted: follow-ups do come
            k = start
            while k < limit and hash_at(k) not in answers:
                k += 1
            while k < limit and answers.pop(hash_at(k), None) is not None:
                self._wanted[ANSWER] += 1
                k += 1
        parent = hash_at(j - 1)
        passed = []
        # The floor's evidence: the blocks plain LRU evicted from tier 3 in one run from the hit's end, by
        # which the hit would have been longer had it kept them. Behind a block neither cached nor such a
        # ghost no hit reaches (an edit's cut point deep in a sliding history, whose interior no order kept)
        missed = 0
        run = True
        if start == 0:
            ghost = ghosts.get(parent)
            run = ghost is not None and ghost[2]
            missed = int(run)
        while j < limit:
            child = children.get(parent)
            if child is None:
                break
            h = hash_at(j)
            if child != h:
                if parent not in self.forks:
                    self._fork(parent)
                    self._left_branch(child)
                break
            ghost = ghosts.get(h)
            if ghost is not None:
                passed.append(h)
            if run:
                if ghost is not None and ghost[2]:
                    missed += 1
                else:
                    run = False
            parent = h
            j += 1
        while j < limit:                # past a fork (or a forgotten child) the request's own chain goes
            h = hash_at(j)              # on: its evicted blocks are ghosts too (a session's chain behind a
            ghost = ghosts.get(h)       # shared system prompt)
            if ghost is None:
                break
            passed.append(h)
            if run:
                if ghost[2]:
                    missed += 1
                else:
                    run = False
            j += 1
        if passed:                      # an evicted chain votes once (a request may be looked up again and
            self._passed(passed, missed)  # again while it waits)

    def _left_branch(self, child: bytes) -> None:
        """A lookup left a remembered chain at a new fork: that chain's blocks from ``child`` on that wait in a
        finished follow-up's chain (``Bin.gap``: its session came back before) join tier 2 under the LEFT claim.
        On a sliding layout an edit's hit takes dropped blocks only, and the trailing window above its cut
        waits in the chain; with full attention the chain holds every block above the cut. The walk follows
        at most a pool's worth of links, once per fork."""
        if not self._cached or not self._holds(LEFT):
            return
        children, proven = self.children, self._proven
        k, n = child, 0
        while k is not None and n < self._pool_units:
            for cached in self._cached:
                for e in cached.get(k, {}).values():
                    if self._waiting(e, k):
                        b = e.bin
                        if b.batches is not None and b.batches is not proven and b.gap and not b.dropped:
                            self._detach(e)
                            self._claim(e, LEFT)
                            self._wait_in(e, SPECULATIVE)
            k = children.get(k)
            n += 1

    def recomputed(self, block_hash: bytes) -> None:
        """A block of this hash was computed and cached. If it is a ghost of a batch no lookup passed, its reuse
        was missed all the same: a sliding session's evicted trailing window sits behind a history whose
        dropped interior no order kept (never a ghost) and whose links the bounded chain map forgot, so the
        walk never reaches it (docs/retention-rounds.md, thirtieth round). One vote per evicted batch, a
        walk's included: a lookup that hit nothing walks from the second block (the first has no parent to
        follow), so a chain it passed comes back here with its first block (thirty-second round). A block a
        running request dropped below no fork casts none: an edit's prefill computes such blocks again below
        its cut, which is tier 1's claim failing (checked there), and as votes they turned tier 3
        youngest-first on edits (thirty-first round)."""
        ghost = self._ghosts.get(block_hash)
        if ghost is None or ghost[5]:
            return
        voted = self._voted_batches
        if ghost[0] in voted:
            del self._ghosts[block_hash]
            return
        self._passed([block_hash], 0)

    def _passed(self, passed: list, missed: int) -> None:
        """Ghosts of one evicted chain met again (``passed``, deepest last; ``missed``: the floor's evidence,
        the blocks of them LRU's own order evicted in one run from a hit's end): the votes they cast."""
        ghosts = self._ghosts
        stamp, youngest = ghosts[passed[-1]][:2]
        gap, proven = ghosts[passed[-1]][6:8]
        voted = self._voted_batches    # its blocks computed again later cast no second vote
        if gap and stamp not in voted:  # a session's return, counted once
            self._returned(self._clock - stamp, gap)
        if self._overdue_gone.pop(stamp, 0) is None:    # an overdue chain evicted, back
            self._count_overdue(0, 1)
        voted[stamp] = None
        if len(voted) > VOTED:
            voted.popitem(last=False)
        sides = by_count = 0
        for h in passed:
            ghost = ghosts.pop(h)
            side = ghost[3]
            sides |= 1 if side > 0 else 2 if side < 0 else 0
            if ghost[4] > 0:
                by_count |= 1
            elif ghost[4] < 0 and self._clock - ghost[0] <= self._reusable_units:
                by_count |= 2           # the frequency order evicted it, the release order would still hold it
        if by_count & 1:
            self._frequency_votes = min(VOTE_CAP, self._frequency_votes + 1)
        if by_count & 2:
            self._frequency_votes = max(-VOTE_CAP, self._frequency_votes - PENALTY)
        if sides & 1:
            self._tails = min(VOTE_CAP, self._tails + 1)        # chains first would have kept it
        if sides & 2:
            self._tails = max(-VOTE_CAP, self._tails - PENALTY)  # LRU's merged order would have
        if missed and self.floor.follow_lru and self._votes >= THRESHOLD:
            self.floor.tiers_vs_lru(missed)     # LRU evicted it, the tiers would have kept old chains
        distance = self._clock - stamp
        self._reused_after(distance)
        if not youngest:
            if proven or distance <= self._horizon():   # past it, keeping old chains would have lost it too
                self._vote(1)           # LRU evicted what was needed: keep old chains
        elif distance <= self._reusable_units:
            self._vote(-PENALTY)        # youngest-first evicted what LRU would have kept
            again = self._quick_again
            for h in passed:
                again[h] = None
            while len(again) > self._cap:
                again.popitem(last=False)

    def _reused_after(self, distance: int) -> None:
        self._distances.append(distance)
        self._horizon_for = None

    def _horizon(self) -> int:
        """The keep-time that serves most of the latest reuses. Youngest-first keeps a chain it lets in until
        the chain passes the horizon H and lets in about V / H of them (V: what tier 3 can hold, the pool's
        units, or what it holds where that is more), so it serves a reuse at distance d <= H about
        min(1, V / H) of the time: H maximises that times the distances within it. So H is never below the
        longest latest distance within the pool, and goes further only where the reuses it adds outweigh the
        share it dilutes (the longest distance, before, held every stale chain open for the rarest reuse)."""
        volume = max(1, self._pool_units, self._reusable_units)
        memo = self._horizon_for           # asked at every eviction while youngest-first; in a pool the
        if memo is not None and memo[0] == volume:      # volume is the pool's, so it changes with a distance
            return memo[1]
        ordered = sorted(self._distances)
        if not ordered:
            return 0
        i = bisect_right(ordered, volume)
        best, horizon = float(i), ordered[i - 1] if i else 0
        for n in range(i, len(ordered)):
            served = (n + 1) * volume / ordered[n]
            if served >= best:
                best, horizon = served, ordered[n]
        self._horizon_for = (volume, horizon)
        return horizon

    def lost_to_lru(self) -> None:
        """An admission got less than plain LRU would have granted: whatever the ghosts said, tier 3 goes
        back to LRU order (keeping old chains is a guess that such a hit proves wrong)."""
        self._votes = min(self._votes, 0)

    def _fork(self, parent: bytes) -> None:
        self.forks[parent] = None
        if len(self.forks) > self._cap:
            self.forks.popitem(last=False)

    def _vote(self, v: int) -> None:
        self._votes = max(-VOTE_CAP, min(VOTE_CAP, self._votes + v))

    # -- which free entries a new block is made of ---------------------------------------------
    def take(self, kind: int) -> list:
        """Free entries to make one block of ``kind`` from (the caller checked that enough units are free):
        ``[composite of kind]`` to reuse as is, or entries whose units, in order, compose it."""
        out = self._take(kind)
        if not self.fresh:
            self.floor.trim(self.lru_units)
        return out

    def pop_empty_unit(self):
        """The front loose unit of the empty tier (holding nothing), or None: ``take`` of a width-1 kind
        while there is one, without its generality."""
        empty = self._tiers[EMPTY]
        if not empty.loose and self._never_at == len(self._never):
            return None
        self.fresh = True
        return self._pop_empty(1)[0]

    def pop_empty_run(self, kind: int) -> tuple[int, ...] | None:
        """The ids of ``k`` never-used units at the empty tier's front for a block of ``kind`` (width ``k``),
        or None where ``take`` must look further (fewer of them left, or other entries wait in front of
        them): ``take``'s common case while the pool has room, one slice (gemma's sliding block is 26 units)."""
        k = self.widths[kind]
        at = self._never_at
        if at + k > len(self._never):
            return None
        empty = self._tiers[EMPTY]
        for q in (empty.loose, empty.composites[kind]):    # pushed to the back (after them), as a rule
            if q and next(iter(q.values())).order < self._never[at].order:
                return None
        self.fresh = True
        self._never_at = at + k
        empty.units -= k
        self.num_free_units -= k
        return tuple(self._never_ids[at:at + k])

    def _take(self, kind: int) -> list:
        k = self.widths[kind]
        tiers = self._tiers
        empty = tiers[EMPTY]
        if len(empty.loose) + len(self._never) - self._never_at >= k and not (k > 1 and empty.composites[kind]):
            self.fresh = True                            # the common case while the pool has room
            return self._pop_empty(k)
        self._settle()
        self.fresh = False
        if k == 1 and not self.floor.follow_lru:         # the front loose unit of the first tier with room
            for b in tiers:
                if b.units:
                    if b.loose:
                        return [self._pop(next(iter(b.loose.values())), b)]
                    break
            else:
                if self._frequency_first():
                    entry = self._frequency_order.front(self._live)
                    if entry is not None:
                        return [self._pop(entry, entry.bin, by_frequency=True)]
        lower: list[Bin] = []
        have = lower_loose = 0
        for b in self._bins():
            if not b.units:
                continue
            same = b.composites[kind]
            if same:
                c = same[next(iter(same))]
                loose = b.loose
                if not (lower_loose + len(loose) >= k
                        and (lower_loose or loose[next(iter(loose))].order < c.order)):
                    return [self._pop(c, b)]
            if have + b.units >= k:
                break
            lower.append(b)
            have += b.units
            lower_loose += len(b.loose)
        else:
            raise RuntimeError(f"fewer than {k} free units for a block of group {kind}")
        out = []
        for low in lower:                      # fewer than k units in all: every entry goes
            out += [self._pop(e, low) for e in low.entries()]
        while have < k and b.loose:
            out.append(self._pop(next(iter(b.loose.values())), b))
            have += 1
        while have < k:                        # dissolve the bin's frontmost composites of other kinds
            q = min((q for q in b.composites if q), key=lambda q: q[next(iter(q))].order)
            entry = self._pop(q[next(iter(q))], b)
            out.append(entry)
            have += len(entry.units)
        return out

    def _bins(self):
        """Every bin in eviction order: the three tiers, then tier 3's batches. The older front of chains
        and proven batches first (LRU); keeping old chains, only while it is past the horizon (a proven batch:
        past the longest recent reuse distance), then the chains youngest first, then the proven batches.
        Bins must not change while this runs. Below the floor (``floor.follow_lru``): the empty tier, then
        content plain LRU does not hold, then the rest in plain LRU order."""
        if self.floor.follow_lru:
            yield self._tiers[EMPTY]
            if self.floor.reference is self.floor.dense:
                yield self._lru_out
                yield self._lru_in
            else:
                yield self._sparse_out
                yield self._sparse_in
            return
        yield from self._tiers
        if self._tails > 0 and self._votes < THRESHOLD:     # chains (LRU among them), then proven, by stamp
            chains, quick = iter(self._chains.values()), iter(self._quick.values())
            c, q = next(chains, None), next(quick, None)
            while c is not None or q is not None:
                if q is None or (c is not None and c.stamp < q.stamp):
                    b, c = c, next(chains, None)
                else:
                    b, q = q, next(quick, None)
                b.young = False
                yield b
            for b in self._proven.values():
                b.young = False
                yield b
            return
        cut = cut_proven = None
        first: set[int] | tuple = ()
        if self._votes >= THRESHOLD:
            cut = self._clock - self._horizon()
            cut_proven = self._clock - (max(self._distances) if self._distances else 0)
            if self._ended():           # chains past their deadline: their sessions ended
                first = set()
                for b in self._overdue_chains():
                    first.add(id(b))
                    b.young = False
                    yield b
        chains, quick, proven = (iter(self._chains.values()), iter(self._quick.values()),
                                 iter(self._proven.values()))
        c, q, p = next(chains, None), next(quick, None), next(proven, None)
        while True:                     # the three lists merged by stamp (a chain before proven on a tie)
            b = c
            if q is not None and (b is None or q.stamp < b.stamp):
                b = q
            if (p is not None and (b is None or p.stamp < b.stamp)
                    and (cut_proven is None or p.stamp < cut_proven)):
                b = p
            if b is None or (cut is not None and b.stamp >= cut):
                break
            if id(b) not in first:
                b.young = False
                yield b
            if b is c:
                c = next(chains, None)
            elif b is q:
                q = next(quick, None)
            else:
                p = next(proven, None)
        if c is not None:
            for b in reversed(self._chains.values()):
                if id(b) not in first:
                    b.young = True
                    yield b
                if b is c:
                    break
        if q is not None:               # quick chains, also youngest first
            for b in reversed(self._quick.values()):
                if id(b) not in first:
                    b.young = True
                    yield b
                if b is q:
                    break
        while p is not None:
            p.young = False
            yield p
            p = next(proven, None)

    def _frequency_first(self) -> bool:
        """Tier 3 follows the frequency order now (not below the floor, where LRU's order rules): while the
        answer claim is not refuted (follow-ups have not shown), whatever order tier 3 keeps, since a chain
        no follow-up extends is worth the later prompts that contain it, not its release (with windows, while
        chains fit them); else, full attention only, while the ghosts prefer it to the release order."""
        if not self.frequency or self.floor.follow_lru:
            return False
        if not self._answer_refuted():
            return not self.windows or self._fits > 0
        return not self.windows and self._frequency_votes > 0 and self._votes < THRESHOLD

    def _answer_refuted(self) -> bool:
        """Follow-ups have shown: more than one in ``DOUBT`` of the evidence on the answer claim went against
        it. Weaker than the claim's failing to hold (``_holds``), which needs ``DOUBT`` times as much for it:
        at the start, with no evidence either way, the claim does not hold and is not refuted."""
        return self._wanted[ANSWER] * DOUBT > self._claimed[ANSWER]

    @staticmethod
    def _live(item) -> bool:
        """A heap item still stands for its entry: it waits in tier 3 since the push that made the item."""
        _, _, order, entry = item
        b = entry.bin
        return (entry.order == order and b is not None and b.batches is not None
                and b.loose.get(entry.block_id) is entry)

    def _pop_empty(self, n: int) -> list:
        """The ``n`` front loose units of the empty tier: those pushed to its front, the never-used ones,
        those pushed to its back."""
        empty = self._tiers[EMPTY]
        loose = empty.loose
        never, at = self._never, self._never_at
        out = []
        for _ in range(n):
            if loose and (at == len(never) or next(iter(loose.values())).order < never[at].order):
                out.append(loose.popitem(last=False)[1])
            else:
                out.append(never[at])
                at += 1
        self._never_at = at
        empty.units -= n
        self.num_free_units -= n
        return out

    def _settle(self) -> None:
        """Enter the never-used units left into the empty tier's dict, in their place, for the general take
        (in practice fewer than a block's width are left by the time it runs with them)."""
        never = self._never[self._never_at:]
        if never:
            loose = self._tiers[EMPTY].loose
            behind = [e for e in loose.values() if e.order > never[0].order]
            for e in never:
                loose[e.block_id] = e
            for e in behind:
                loose.move_to_end(e.block_id)
        self._never, self._never_ids, self._never_at = [], [], 0

    def _pop(self, entry, b: Bin, by_frequency: bool = False):
        """Take ``entry`` (visited in bin ``b``; ``by_frequency``: chosen by the frequency order) for new
        content (a tier-3 entry with a hash leaves a ghost)."""
        if entry.claim:
            gone = self._claim_gone
            gone[(entry.group, entry.block_hash)] = entry.claim
            if entry.claim == ANSWER:
                self._answer_gone(entry.block_hash)
            entry.claim = 0
            if len(gone) > self._cap:
                gone.popitem(last=False)
        if entry.block_hash is not None:
            self.floor.evicted = True
            self._evicted += len(entry.units)
            tier = entry.bin
            if (tier.gap and self._clock > tier.stamp + LATE * tier.gap
                    and tier.stamp not in self._overdue_gone):      # an overdue chain evicted
                gone = self._overdue_gone
                gone[tier.stamp] = None
                if len(gone) > self._cap:
                    gone.popitem(last=False)
                self._count_overdue(1, 0)
            if tier.batches is not None:
                ghosts = self._ghosts
                proven = tier.batches is self._proven
                if proven:
                    self._proven_evicted += len(entry.units)
                side = 0       # which order of chains and proven blocks evicted it while the other waited
                if not self.floor.follow_lru and self._votes < THRESHOLD:
                    if proven and self._tails <= 0 and self._chain_units:
                        side = 1
                    elif not proven and self._tails > 0 and self._reusable_units > self._chain_units:
                        side = -1
                # and whether the other of the release and frequency orders would have kept it: -1, the
                # frequency order evicted it; 1, the release order did while a lower magnitude waited (for
                # the duel, which layouts with windows do not hold)
                by_count = 0
                if self.frequency and not self.windows and not self.floor.follow_lru and self._votes < THRESHOLD:
                    if by_frequency:
                        by_count = -1
                    else:
                        order = self._frequency_order
                        front = order.front(self._live)
                        if front is not None and order.key(entry) > order.key(front):
                            by_count = 1
                ghosts[entry.block_hash] = (tier.stamp, tier.young and b is tier, self.floor.follow_lru, side,
                                            by_count, tier.dropped, tier.gap, proven)
                ghosts.move_to_end(entry.block_hash)
                if len(ghosts) > self._cap:
                    ghosts.popitem(last=False)
        self._unlink(entry)
        return entry

    def _unlink(self, entry) -> None:
        self._detach(entry)
        if entry.lru is not None:
            self._lru_unlink(entry)
        if entry.lru_sparse is not None:
            self._sparse_unlink(entry)

    def _detach(self, entry) -> None:
        """Out of its tier or batch (still free: its place in the LRU order stays)."""
        b = entry.bin
        del (b.loose if entry.kind < 0 else b.composites[entry.kind])[entry.block_id]
        n = self._units_of_kind[entry.kind]
        b.units -= n
        self.num_free_units -= n
        if b.batches is not None:
            self._reusable_units -= n
            if b.batches is not self._proven:
                self._chain_units -= n
            if not b.units:
                del b.batches[id(b)]

    def _release_batches(self, chain: list, proven: list, dropped: bool = False, gap: int = 0) -> None:
        """One release into tier 3: both batches get the same stamp; the chain goes first on a tie. A chain of
        known ``gap`` gets its deadline."""
        units = sum(len(x.units) for x in chain) + sum(len(x.units) for x in proven)
        waiting = self._reusable_units
        self._clock += units
        self._reusable_units += units
        quick = False
        again = self._quick_again
        for block in chain:
            if block.quick or (again and block.block_hash in again):
                quick = True
                break
        chain_units = self._chain_units
        for blocks, batches in ((chain, self._quick if quick else self._chains), (proven, self._proven)):
            if blocks:
                b = Bin(self.widths, self._clock, batches)
                b.due = self._evicted + (waiting if batches is self._proven else 0)
                b.ahead = self._proven_evicted + chain_units
                b.dropped = dropped
                for block in blocks:
                    self._push(block, b)
                if batches is not self._proven:
                    self._chain_units += b.units
                    if gap:
                        b.gap = gap
                        self._deadline(b)
                batches[id(b)] = b

    def _deadline(self, b: Bin) -> None:
        """A chain of known gap goes first once LATE times that old (``_overdue_chains``). Deadlines of chains
        gone are dropped when they outnumber the chains waiting twice over: a bounded heap, O(log n) a chain."""
        deadlines = self._deadlines
        heappush(deadlines, (b.stamp + LATE * b.gap, b.stamp, id(b), b))
        if len(deadlines) > 2 * (len(self._chains) + len(self._quick)) + 64:
            deadlines[:] = [d for d in deadlines if self._waits(d[3])]
            heapify(deadlines)

    @staticmethod
    def _waits(b: Bin) -> bool:
        """A tier-3 batch still waits (an emptied one leaves its batches)."""
        return b.units > 0 and b.batches.get(id(b)) is b

    def _overdue_chains(self) -> list:
        """The chains waiting past their deadline, oldest first."""
        deadlines, overdue, clock = self._deadlines, self._overdue, self._clock
        while deadlines and deadlines[0][0] < clock:
            _, stamp, key, b = heappop(deadlines)
            if self._waits(b):
                insort(overdue, (stamp, key, b))
        overdue[:] = [d for d in overdue if self._waits(d[2])]
        return [d[2] for d in overdue]

    def _returned(self, age: int, gap: int) -> None:
        """A chain of known gap came back (a hit, or a lookup passing its ghost) after ``age`` tier-3 units:
        on time within LATE times the gap, late beyond. The counts halve past RETURNS."""
        returns = self._returns
        returns[age > LATE * gap] += 1
        if returns[0] + returns[1] > RETURNS:
            returns[0] //= 2
            returns[1] //= 2

    def _count_overdue(self, overdue: int, back: int) -> None:
        """The claim checked on the chains it acts on: ``overdue`` chains met past their deadline (evicted, or
        hit late), ``back`` of them came back (the late hit, a lookup passing an evicted one's ghost). The counts
        halve past RETURNS."""
        counts = self._overdue_counts
        counts[0] += overdue
        counts[1] += back
        if counts[0] > RETURNS:
            counts[0] //= 2
            counts[1] //= 2

    def _ended(self) -> bool:
        """The ended-session claim holds: sessions come back within LATE times their last gap or not at all,
        so a chain past its deadline was its session's last. In doubt until shown: it holds once at least
        ``DOUBT`` times as many returns came on time as came late, plus one (agent loops come back late after
        long tool calls, a quarter of the time, and each such return missed costs a whole chain), and while at
        most one in ``DOUBT`` of the overdue chains met came back (a Zipf user's cold session comes back at
        any time: its gaps are not a cycle)."""
        on_time, late = self._returns
        overdue, back = self._overdue_counts
        return (late + 1) * DOUBT <= on_time and back * DOUBT <= overdue

    def _push(self, block, b: Bin, front: bool = False) -> None:
        queue = b.loose if block.kind < 0 else b.composites[block.kind]
        queue[block.block_id] = block
        if front:
            self._front -= 1
            block.order = self._front
            queue.move_to_end(block.block_id, last=False)
        else:
            block.order = self._back
            self._back += 1
        block.bin = b
        if self.frequency and b.batches is not None:
            self._frequency_order.push(block, self._live, 2 * self._cap)
        n = self._units_of_kind[block.kind]
        b.units += n
        self.num_free_units += n

    # -- reset, checks -------------------------------------------------------------------------
    def forget(self) -> None:
        """Every hash was dropped (``reset_prefix_cache``): every free entry holds nothing now; what was
        learnt from hashes (children, forks, ghosts) goes too."""
        entries = self.entries()
        widths, cap, frequency, sparse = self.widths, self.floor.cap, self.frequency, self.floor.sparse
        windows = self.windows
        self.__init__([], widths, self.last_message_tokens, self._cached, cap)
        self.frequency, self.windows = frequency, windows
        if sparse is not None:
            self.watch_sparse()
        empty = self._tiers[EMPTY]
        for e in entries:
            e.lru = e.lru_sparse = None
            e.claim = 0
            self._push(e, empty)
        self._cap = max(16, 2 * self.num_free_units)
        self._pool_units = self.num_free_units
        self.floor.reset()

    def entries(self) -> list:
        """Every free entry (loose unit or composite) in eviction order, front first (tests, checks)."""
        out = []
        by_frequency = self._frequency_first()
        for b in self._bins():
            if b is self._tiers[EMPTY] and self._never_at < len(self._never):
                out += sorted(b.entries() + self._never[self._never_at:], key=lambda e: e.order)
            elif b.batches is not None and by_frequency:
                break
            else:
                out += b.entries()
        if by_frequency:
            out += sorted((e for bins in (self._chains, self._quick, self._proven) for b in bins.values()
                           for e in b.entries()), key=self._frequency_order.rank)
        return out

    def ids(self) -> list[int]:
        return [b.block_id for b in self.entries()]
