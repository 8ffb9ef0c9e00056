"""Bytes per restored hit: what the host tier loads for a prefix hit of 8k / 32k / 128k tokens, window-aware
vs the same model with every layer treated as full attention, on gemma-3-27b and gpt-oss-20b (block 16).

Scenario, through the manager's public API (``kvmanager/host_tier.py``): request A (``h`` tokens) is
prefilled and finished, which stores what a hit can still need; its copies are fenced; request B, as long,
takes every device unit (A's device copies are gone) and is preempted; request C = A + one token looks up
(hit ``h``, every needed block on host only) and its hit is allocated: the loads it schedules are counted,
in bytes (units x the layout's unit bytes). Also printed: the bytes A's release stored.

The figure is asserted equal to the hand derivation in docs/performance.md ("Host tier: bytes per
restored hit"): per layer and token, K and V take ``2 x kv_heads x head x 2`` bytes (bf16); a hit of ``h``
tokens loads every full-attention layer's ``h`` tokens and every sliding layer's last
``ceil((W - 1) / 16)`` blocks of 16 tokens. The doc's numbers are in ``HAND`` below, copied from it.

    PYTHONPATH=$PWD python bench/host_tier.py

``--hit-rates``: the retention bench's serving loop (``bench/retention.py``: the same workloads, draws and
pools) at the tightest device pool, swakv without the tier and with a host tier of 1x, 4x and 16x the
device pool's units (and 16x with ``host_speculative_stores``), against the unbounded ceiling. Copies
complete at once here (the engine fences every copy before the next step): this is the tier's hit rate,
not its timing.

    PYTHONPATH=$PWD python bench/host_tier.py --hit-rates --draws 2 --seed 7
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvmanager import KVCacheManager, Request  # noqa: E402
from kvmanager.host_tier import HostRef  # noqa: E402
from kvmanager.planning import as_full_attention, kv_layout  # noqa: E402
from workers.sim.presets import layer_specs  # noqa: E402

BLOCK = 16
HITS = (8192, 32768, 131072)
# docs/performance.md, "Host tier: bytes per restored hit": (model, hit tokens) -> (window-aware, as-full)
HAND = {
    ("gemma-3-27b", 8192): (1_107_296_256, 4_160_749_568),
    ("gemma-3-27b", 32768): (3_120_562_176, 16_642_998_272),
    ("gemma-3-27b", 131072): (11_173_625_856, 66_571_993_088),
    ("gpt-oss-20b", 8192): (204_472_320, 402_653_184),
    ("gpt-oss-20b", 32768): (808_452_096, 1_610_612_736),
    ("gpt-oss-20b", 131072): (3_224_371_200, 6_442_450_944),
}


def restored_bytes(specs: dict, h: int) -> tuple[int, int]:
    """(bytes loaded for C's hit, bytes A's release stored) with this layout."""
    layout = kv_layout(specs)
    unit = layout.block_bytes
    per_request = layout.blocks_per_request(h, h)        # a whole-prompt prefill holds every block
    mgr = KVCacheManager(layout.group_specs, per_request + 1, max_model_len=h + 1, widths=layout.group_widths,
                         num_host_blocks=per_request, last_message_tokens=0)
    widths = mgr.widths
    a = Request("a", [1 + i % 1000 for i in range(h)])
    assert mgr.allocate_slots(a, h) is not None
    a.num_computed_tokens = h
    mgr.free(a)
    t = mgr.take_transfers()
    mgr.transfers_done([d for _, d, _ in t.stores])
    stored = sum(len(hb.units) for entries in mgr.host_tier.entries for hb in entries.values()) * unit
    b = Request("b", [2000 + i % 1000 for i in range(h)])
    assert mgr.allocate_slots(b, h) is not None           # every device unit: A's copies are gone
    b.num_computed_tokens = h
    mgr.preempt(b)
    c = Request("c", a.prompt_token_ids + [7])
    hit, got = mgr.get_computed_blocks(c)
    assert got == h, (got, h)
    assert mgr.allocate_slots(c, 0, num_new_computed_tokens=got, new_computed_blocks=hit) is not None
    t = mgr.take_transfers()
    return sum(widths[g] for g, _, _ in t.loads) * unit, stored


class HostTierAdapter:
    """``retention.SwakvAdapter`` with a host tier of ``host_units``; every copy is fenced as soon as it is
    scheduled (a hit with loads is allocated alone, its loads fenced, then its tokens)."""

    def __new__(cls, windows, num_blocks: int, host_units: int, units=None, speculative: bool = False):
        from retention import SwakvAdapter

        class Adapter(SwakvAdapter):
            def __init__(self):
                super().__init__(windows, num_blocks, units=units)
                old = self.mgr
                self.mgr = KVCacheManager(old.specs, num_blocks=old.num_blocks, max_model_len=old.max_model_len,
                                          widths=old.widths, num_host_blocks=host_units,
                                          host_speculative_stores=speculative)
                self.loaded_units = 0

            def fence(self):
                t = self.mgr.take_transfers()
                self.loaded_units += sum(self.mgr.widths[g] for g, _, _ in t.loads)
                lost = self.mgr.transfers_done([d for _, d, _ in t.stores] + [d for _, _, d in t.loads])
                assert not lost

            def allocate(self, req, n, hit=0, blocks=None):
                if blocks is not None and any(type(b) is HostRef for g in blocks for b in g):
                    if self.mgr.allocate_slots(req, 0, hit, blocks) is None:
                        return False
                    self.fence()
                    req.num_computed_tokens += hit       # the loads are in: compute from there
                    ok = self.mgr.allocate_slots(req, n) is not None
                    req.num_computed_tokens -= hit       # the loop advances it itself (``admitted``)
                    if not ok:                           # no room for its tokens: give the hit back
                        self.mgr.preempt(req)
                    return ok
                ok = self.mgr.allocate_slots(req, n, hit, blocks) is not None
                self.fence()
                return ok

            def preempt(self, req):
                self.mgr.preempt(req)
                self.fence()

            def free(self, req):
                self.mgr.free(req)
                self.fence()

        return Adapter()


def hit_rates(args) -> None:
    from retention import FAMILIES, UNITS, SimAdapter, SwakvAdapter, pool_sizes, serve, windows_of
    from retention import draw_settings
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed}; tightest device pool per (draw, family, layout); hit rate = prompt tokens served "
          f"from either tier at first admission / prompt tokens")
    print(f"{'draw':>4} {'family':<9} {'layout':<8} {'pool/grp':>8} {'ceiling':>8} {'no tier':>8} "
          f"{'host 1x':>8} {'host 4x':>8} {'host 16x':>8} {'16x gap':>8} {'16x+spec':>8} {'gap':>6}")
    for draw in draw_settings(seed, args.draws):
        for family in args.families:
            for layout in args.layouts:
                workload = FAMILIES[family](draw.workload_seed)
                windows = windows_of(layout, draw.window)
                kw = dict(step_tokens=draw.chunk, max_running=draw.concurrency)
                ceiling = SimAdapter(windows, None)
                top = serve(workload, ceiling, **kw)["hit_rate"]
                pool = pool_sizes(workload, layout, windows, draw.concurrency, len(ceiling.mgr.blocks) - 1)[0]
                num_blocks = pool * len(windows) + 1
                units = UNITS.get(layout)
                plain = SwakvAdapter(windows, num_blocks, units=units)
                rates = [serve(workload, plain, **kw)["hit_rate"]]
                device_units = plain.mgr.num_blocks - 1
                for factor, spec in ((1, False), (4, False), (16, False), (16, True)):
                    adapter = HostTierAdapter(windows, num_blocks, factor * device_units, units=units,
                                              speculative=spec)
                    rates.append(serve(workload, adapter, **kw)["hit_rate"])
                print(f"{draw.index:>4} {family:<9} {layout:<8} {pool:>8} {top:>8.3f} "
                      + " ".join(f"{r:>8.3f}" for r in rates[:4]) + f" {top - rates[3]:>8.3f}"
                      + f" {rates[4]:>8.3f} {top - rates[4]:>6.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hit-rates", action="store_true", help="the retention cell instead of the bytes table")
    ap.add_argument("--draws", type=int, default=1)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--families", type=lambda s: s.split(","), default=["chat", "agent", "rag"])
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=["hybrid", "gemma3"])
    args = ap.parse_args()
    if args.hit_rates:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        return hit_rates(args)
    print(f"{'model':<12} {'hit':>7} {'loaded, window-aware':>21} {'as-full':>16} {'ratio':>6} "
          f"{'stored at release':>18} {'s':>5}")
    for model in ("gemma-3-27b", "gpt-oss-20b"):
        specs = layer_specs(model, BLOCK)
        for h in HITS:
            t0 = time.perf_counter()
            aware, stored = restored_bytes(specs, h)
            full, _ = restored_bytes(as_full_attention(specs), h)
            assert (aware, full) == HAND[(model, h)], (model, h, aware, full, HAND[(model, h)])
            print(f"{model:<12} {h:>7} {aware:>21,} {full:>16,} {full / aware:>5.2f}x {stored:>18,} "
                  f"{time.perf_counter() - t0:>5.1f}")
    print("every figure equals docs/performance.md's hand derivation")


if __name__ == "__main__":
    main()
