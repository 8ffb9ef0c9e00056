"""Retention, goal 1, as a stateful property through the public API: no cached block is evicted while a
never-filled block is free.

Equivalently: as long as the pool holds units no allocation ever handed out (at least one block's worth
of them), every block ever cached is still cached, so every lookup returns the hit an oracle computes from
*everything ever cached* (the BRIEF's hit rule, brute force). Once the pool has handed out all its units,
eviction is legitimate and the check becomes "never more than the oracle". Also: reset_prefix_cache()
while requests hold blocks returns False and changes nothing.

Requests share prefixes drawn from a few stems, so hits, drops, forks and frees interleave. Layouts: the
shapes real models have, scaled down (block 4): sliding only (Mistral), alternating full / sliding
(gpt-oss), 5 sliding : 1 full (Gemma-3, one group per layer slot), Gemma-3 as one group per kind with
composite blocks (widths 5 and 1), full + sliding with a window shorter than a block.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmanager import NULL_BLOCK_ID, FullAttention, KVCacheManager, Request, SlidingWindow

B = 4
LAYOUTS = {   # specs, widths
    "mistral": ([SlidingWindow(B, window=10)], None),
    "gpt-oss": ([FullAttention(B), SlidingWindow(B, window=8)], None),
    "gemma-3": ([SlidingWindow(B, window=12)] * 5 + [FullAttention(B)], None),
    "gemma-3-units": ([SlidingWindow(B, window=12), FullAttention(B)], (5, 1)),
    "short-window": ([FullAttention(B), SlidingWindow(B, window=3)], None),
}
STEMS = [[(s * 31 + i * 7) % 97 + 1 for i in range(40)] for s in range(3)]


def oracle_hit(specs, ever: list[set], tokens: list[int]) -> int:
    """Largest h (a multiple of B, below len(tokens)) every group accepts, given the sets of token
    prefixes (tuples, one per full block) each group ever cached."""
    for h in range((len(tokens) - 1) // B * B, 0, -B):
        if all(all(tuple(tokens[:(j + 1) * B]) in cached for j in range(spec.first_needed_token(h) // B, h // B))
               for spec, cached in zip(specs, ever)):
            return h
    return 0


class RetentionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.reqs: dict[str, Request] = {}      # running (holding blocks)
        self.waiting: dict[str, Request] = {}   # preempted, to be resumed
        self.n = 0

    @initialize(layout=st.sampled_from(sorted(LAYOUTS)), num_blocks=st.integers(24, 120))
    def start(self, layout, num_blocks):
        self.specs, widths = LAYOUTS[layout]
        self.mgr = KVCacheManager(self.specs, num_blocks=num_blocks, max_model_len=512, widths=widths)
        self.widths = widths or (1,) * len(self.specs)
        self.units = {}                           # composite id -> its units, as the workers learn them
        self.ever = [set() for _ in self.specs]
        self.handed_out: set[int] = set()         # units any allocation ever handed out
        self.num_blocks = num_blocks

    # -- helpers -----------------------------------------------------------------------------------
    def pristine_left(self) -> bool:
        """Enough never-handed-out units for a block of any group."""
        return self.num_blocks - 1 - len(self.handed_out) >= max(self.widths)

    def record(self, req: Request, new_ids, num_computed_before: int, num_tokens_after: int) -> None:
        """What the manager caches: every full block of known tokens the request's tables hold."""
        for _, block_id, units in self.mgr.pop_compositions():
            self.units[block_id] = units
        for g, ids in enumerate(new_ids):
            for i in ids:
                if i != NULL_BLOCK_ID:
                    self.handed_out.update(self.units[i] if self.widths[g] > 1 else (i,))
        end = min(num_tokens_after, req.num_tokens) // B
        for g, spec in enumerate(self.specs):
            for j in range(spec.first_needed_token(num_computed_before) // B, end):
                self.ever[g].add(tuple(req.all_token_ids[:(j + 1) * B]))

    def check_hit(self, tokens: list[int], hit: int) -> None:
        best = oracle_hit(self.specs, self.ever, tokens)
        if self.pristine_left():
            assert hit == best, (f"hit {hit}, oracle {best}: a cached block was evicted while "
                                 f"{self.num_blocks - 1 - len(self.handed_out)} never-filled units were free")
        else:
            assert hit <= best

    def admit(self, req: Request) -> None:
        blocks, hit = self.mgr.get_computed_blocks(req)
        self.check_hit(req.all_token_ids, hit)
        n = min(8, req.num_tokens - hit)
        new = self.mgr.allocate_slots(req, n, hit, blocks)
        if new is None:
            self.waiting[req.request_id] = req
            return
        self.record(req, new, hit, hit + n)
        req.num_computed_tokens = hit + n
        self.reqs[req.request_id] = req

    # -- rules -------------------------------------------------------------------------------------
    @rule(stem=st.integers(0, 2), cut=st.integers(0, 40), tail=st.lists(st.integers(1, 5), max_size=12))
    def new_request(self, stem, cut, tail):
        tokens = STEMS[stem][:cut] + tail
        if not tokens:
            return
        self.n += 1
        self.admit(Request(f"r{self.n}", tokens))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def resume(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        self.admit(self.waiting.pop(rid))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 9), token=st.integers(1, 5))
    def step(self, data, chunk, token):
        req = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        if req.num_computed_tokens == req.num_tokens:      # decode: the sampled token joins the request
            if req.num_tokens >= 200:
                return
            req.append_output_token_ids([token])
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        before = req.num_computed_tokens
        new = self.mgr.allocate_slots(req, n)
        if new is None:
            self.mgr.preempt(req)
            del self.reqs[req.request_id]
            self.waiting[req.request_id] = req
            return
        self.record(req, new, before, before + n)
        req.num_computed_tokens += n

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        self.mgr.free(self.reqs.pop(data.draw(st.sampled_from(sorted(self.reqs)))))

    @rule(stem=st.integers(0, 2), cut=st.integers(1, 40), tail=st.lists(st.integers(1, 5), max_size=8))
    def probe(self, stem, cut, tail):
        tokens = STEMS[stem][:cut] + tail
        if len(tokens) > 1:
            self.check_hit(tokens, self.mgr.get_computed_blocks(Request("probe", tokens))[1])

    @precondition(lambda self: self.reqs)
    @rule(stem=st.integers(0, 2))
    def reset_while_running_changes_nothing(self, stem):
        before = self.mgr.get_computed_blocks(Request("probe", STEMS[stem]))[1]
        free, order = self.mgr.num_free_blocks, self.mgr.pool.free.ids()
        assert self.mgr.reset_prefix_cache() is False
        assert (self.mgr.num_free_blocks, self.mgr.pool.free.ids()) == (free, order)
        assert self.mgr.get_computed_blocks(Request("probe", STEMS[stem]))[1] == before

    @invariant()
    def pool_accounting_is_exact(self):
        if hasattr(self, "mgr"):
            held = set()             # (group, block id): requests share hit blocks
            for rid in self.reqs:
                for g, ids in enumerate(self.mgr.get_block_ids(rid)):
                    held.update((g, i) for i in ids if i != NULL_BLOCK_ID)
            assert self.mgr.num_free_blocks == self.num_blocks - 1 - sum(self.widths[g] for g, _ in held)

    @invariant()
    def tier_three_counts_what_its_batches_hold(self):
        if hasattr(self, "mgr"):
            free = self.mgr.pool.free
            chains = sum(b.units for q in (free._chains, free._quick) for b in q.values())
            assert free._chain_units == chains
            assert free._reusable_units == chains + sum(b.units for b in free._proven.values())

    @invariant()
    def every_memory_is_bounded_by_twice_the_pool(self):
        if hasattr(self, "mgr"):
            free = self.mgr.pool.free
            cap = max(16, 2 * (self.num_blocks - 1))
            assert len(free.children) <= cap and len(free.forks) <= cap and len(free._ghosts) <= cap


RetentionMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestRetentionInvariant = RetentionMachine.TestCase


def test_oracle_agrees_with_the_manager_on_a_pool_that_never_fills():
    # A check of the oracle itself, independent of any retention policy: one request computed and still
    # running (nothing was ever released, so nothing can have been evicted); a probe with the same first
    # 36 tokens hits 36 = floor(min(36, 40 - 1) / 4) * 4 on every layout.
    for specs, widths in LAYOUTS.values():
        mgr = KVCacheManager(specs, num_blocks=500, max_model_len=512, widths=widths)
        assert mgr.allocate_slots(Request("a", STEMS[0]), 40) is not None
        ever = [{tuple(STEMS[0][:(j + 1) * B]) for j in range(10)} for _ in specs]
        probe = STEMS[0][:36] + [99, 98, 97]
        assert oracle_hit(specs, ever, probe) == 36
        assert mgr.get_computed_blocks(Request("p", probe))[1] == 36
