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
pool sizes) at the two tightest device pools of each cell, on the hybrid layout, gemma-3-27b's and
gpt-oss-20b's real layouts (``HIT_LAYOUTS``): the unbounded ceiling, swakv without the tier, and with a host
tier of 1x, 4x and 16x the device pool's units, window-aware and as-full (storing whole blocks and taking a
host hit only on the whole prefix, as if every layer were full attention: ``HostTier.as_full``), and a
window-aware one of exactly the working set (the units of the pool that never evicts). Settings
are drawn at random (the seed is printed); every cell is printed, then the issue's done criterion as a
count: cells whose host holds the working set (host units >= the units of the pool that never evicts)
within 0.02 of the ceiling. Copies complete at once here (every copy is fenced before the next step): this
is the tier's hit rate, not its timing.

    nice -n 19 env PYTHONPATH=$PWD python bench/host_tier.py --hit-rates --draws 2
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
    scheduled (a hit with loads is allocated alone, its loads fenced, then its tokens). ``as_full``: the
    tier stores and requires whole blocks as if every layer were full attention (``HostTier.as_full``)."""

    def __new__(cls, windows, num_blocks: int, host_units: int, units=None, speculative: bool = True,
                as_full: bool = False):
        from retention import SwakvAdapter

        class Adapter(SwakvAdapter):
            def __init__(self):
                super().__init__(windows, num_blocks, units=units)
                old = self.mgr
                self.mgr = KVCacheManager(old.specs, num_blocks=old.num_blocks, max_model_len=old.max_model_len,
                                          widths=old.widths, num_host_blocks=host_units,
                                          host_speculative_stores=speculative)
                self.mgr.host_tier.as_full = as_full
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


# Layouts of the hit-rate grid: the retention bench's hybrid (one full group, one sliding group of the drawn
# window) and gemma3 (gemma-3-27b's real layout: 26 + 5 units per block, W 1024), and gpt-oss-20b's real
# layout (kvmanager.planning.kv_layout of its preset: a sliding group (W 128) and a full one, 12 layers
# each, one unit per block): the hybrid shape with its own window, whatever the draw.
HIT_LAYOUTS = ("hybrid", "gemma3", "gptoss")
FACTORS = (1, 4, 16)
NEAR = 0.02        # the done criterion: within this of the ceiling once host memory holds the working set


def grid_windows(layout: str, window: int) -> tuple:
    from retention import windows_of
    return (128, None) if layout == "gptoss" else windows_of(layout, window)


def hit_rates(args) -> None:
    from retention import FAMILIES, UNITS, SimAdapter, SwakvAdapter, draw_settings, pool_sizes, serve
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    if not args.speculative:
        print("window-aware columns with host_speculative_stores=False (--known-hits-only: only what a known hit "
              "needs is stored)")
    print(f"seed {seed} (--seed {seed} replays it); hit rate = prompt tokens served from either tier at first "
          f"admission / prompt tokens")
    print("per (draw, family, layout): the two tightest device pools of the retention bench; host tier of 1x, 4x "
          "and 16x the device pool's units, window-aware (aware) and storing whole blocks as if every layer were "
          "full attention (as-full); 'ws' = host units / the units of the pool that never evicts (the working "
          f"set); 'aware ws': a window-aware host of exactly the working set. The done criterion counts the cells with ws >= 1 and a hit rate within {NEAR} of the ceiling")
    head = (f"{'draw':>4} {'W':>5} {'conc':>4} {'chunk':>5} {'family':<8} {'layout':<7} {'pool':>5} {'ceiling':>7} "
            f"{'no tier':>7} " + " ".join(f"{'aware ' + str(f) + 'x':>9}" for f in FACTORS) + " "
            + " ".join(f"{'full ' + str(f) + 'x':>8}" for f in FACTORS) + f" {'aware ws':>8} "
            + " ".join(f"{'ws ' + str(f) + 'x':>7}" for f in FACTORS) + f" {'s':>5}")
    print(head, flush=True)
    rows = []
    for draw in draw_settings(seed, args.draws):
        for family in args.families:
            workload = FAMILIES[family](draw.workload_seed)
            for layout in args.layouts:
                t0 = time.process_time()
                windows = grid_windows(layout, draw.window)
                kw = dict(step_tokens=draw.chunk, max_running=draw.concurrency)
                ceiling = SimAdapter(windows, None)
                top = serve(workload, ceiling, **kw)["hit_rate"]
                sizes = pool_sizes(workload, layout, windows, draw.concurrency, len(ceiling.mgr.blocks) - 1)
                units = UNITS.get(layout)
                whole = SwakvAdapter(windows, sizes[-1] * len(windows) + 1, units=units).mgr.num_blocks - 1
                for pool in sizes[:2]:
                    num_blocks = pool * len(windows) + 1
                    plain = SwakvAdapter(windows, num_blocks, units=units)
                    rates = [serve(workload, plain, **kw)["hit_rate"]]
                    device_units = plain.mgr.num_blocks - 1
                    for as_full in (False, True):
                        for f in FACTORS:
                            adapter = HostTierAdapter(windows, num_blocks, f * device_units, units=units,
                                                      as_full=as_full, speculative=args.speculative and not as_full)
                            rates.append(serve(workload, adapter, **kw)["hit_rate"])
                    adapter = HostTierAdapter(windows, num_blocks, whole, units=units,   # exactly the working set
                                              speculative=args.speculative)
                    rates.append(serve(workload, adapter, **kw)["hit_rate"])
                    ws = [f * device_units / whole for f in FACTORS]
                    rows.append((top, rates, ws))
                    print(f"{draw.index:>4} {draw.window if layout == 'hybrid' else '-':>5} {draw.concurrency:>4} "
                          f"{draw.chunk:>5} {family:<8} {layout:<7} {pool:>5} {top:>7.3f} {rates[0]:>7.3f} "
                          + " ".join(f"{r:>9.3f}" for r in rates[1:4]) + " "
                          + " ".join(f"{r:>8.3f}" for r in rates[4:7]) + f" {rates[7]:>8.3f} "
                          + " ".join(f"{w:>7.2f}" for w in ws) + f" {time.process_time() - t0:>5.0f}", flush=True)
    summarize(rows)


def summarize(rows) -> None:
    """The done criterion as a count, and window-aware against as-full, over rows (ceiling, the 8 rates as
    printed, the 3 ws ratios)."""
    met = {"aware": [0, 0], "as-full": [0, 0]}       # [within NEAR, cells whose host holds the working set]
    gaps = {"aware": [], "as-full": []}
    wins = [0, 0, 0]                                  # aware > as-full, equal, lower (every tier cell)
    for top, rates, ws in rows:
        for name, got, at in (("aware", rates[1:4] + rates[7:8], list(ws) + [1.0]), ("as-full", rates[4:7], ws)):
            for r, w in zip(got, at):
                if w >= 1:
                    met[name][1] += 1
                    met[name][0] += round(top - r, 3) <= NEAR
                    gaps[name].append(top - r)
        for a, b in zip(rates[1:4], rates[4:7]):
            wins[0 if a > b + 1e-9 else 1 if abs(a - b) <= 1e-9 else 2] += 1
    print(f"{len(rows)} rows")
    for name in ("aware", "as-full"):
        g = gaps[name]
        print(f"{name}: {met[name][0]} of {met[name][1]} cells whose host holds the working set are within "
              f"{NEAR} of the ceiling" + (f" (largest gap {max(g):.3f})" if g else ""))
    print(f"window-aware vs as-full, every tier cell: higher {wins[0]}, equal {wins[1]}, lower {wins[2]}")


def report_from(paths) -> None:
    """The counts again from printed tables (several runs' rows together)."""
    rows = []
    for path in paths:
        for line in open(path):
            f = line.split()
            if len(f) == 20 and f[0].isdigit():
                nums = [float(x) for x in f[7:19]]
                rows.append((nums[0], nums[1:9], nums[9:12]))
    summarize(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hit-rates", action="store_true", help="the retention cell instead of the bytes table")
    ap.add_argument("--draws", type=int, default=1)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--families", type=lambda s: s.split(","), default=["chat", "agent", "rag", "edit"])
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=list(HIT_LAYOUTS))
    ap.add_argument("--known-hits-only", dest="speculative", action="store_false",
                    help="--hit-rates: the window-aware tier with host_speculative_stores=False (the default stores "
                         "blocks no known hit needs too, into free host units only)")
    ap.add_argument("--report-from", type=lambda s: s.split(","), help="printed --hit-rates tables: count again")
    args = ap.parse_args()
    if args.report_from:
        return report_from(args.report_from)
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
