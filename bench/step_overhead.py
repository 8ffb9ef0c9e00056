"""Engine host time per decode step and the simulated workers' execute, on gemma-3-27b's layout.

Trace: ``N`` requests (64 / 256 / 1024) with ``--prompt-len``-token prompts are prefilled, then decoded
together for ``--steps`` steps on simulated H100 workers (``build_engine(..., simulated_gpu=...,
sleep_factor=0)``). Per step: ``schedule`` (scheduler + KV-cache manager), ``encode`` (the step's msgpack
payload, as the Ray executor sends it), ``apply`` (results into the scheduler), and, worker side, ``decode``
(the payload) and ``execute`` (the simulated worker's checks, mirrors, sampling, cost model). The engine's
host time is schedule + encode + apply: the mean per step, and ``host_p50`` the median step. Side by side
in the same run: the previous layout (one group per ``S`` layers of a kind: 26 sliding + 5 full groups,
width 1), driven by the same engine and worker code. Also printed: table ids and composition unit ids per
step (deltas per step), and the GPU time the cost model gives the step, which host time must stay well
below. CPU time (``time.process_time``), best round, garbage collection included (a full pass over a pool
of millions of units shows up at 1024 requests). In that trace every decode adds full-attention blocks and
nothing is ever freed, so every new full block is a new composite. ``--churn`` adds the serving steady
state: requests finish and new ones arrive (random prompts of 512..2048 tokens, half behind a shared
512-token prefix, 16..256 output tokens) in a pool 1.1x what the running ones need, so the prefix cache
fills and is recycled; after a warm-up, it prints the ids the deltas carry per step.

    PYTHONPATH=. python bench/step_overhead.py [--requests 64 256 1024] [--steps 64] [--rounds 3]

``--worker``: the real worker's host side of a decode step instead, on the random Gemma-3-1B-shaped model
of ``bench/e2e_gpu.py`` (26 layers, 5 sliding : 1 full; on CPU with tiny widths, since only the layout
matters to the host side): per step, ``check`` (the step's chunks and the incremental table checks),
``mirrors`` (appending the deltas), ``pack`` (the vectorised packing and its one upload), ``tables`` (the
unit tables and slots, device ops), side by side with the previous implementation (``legacy``: per-request
list tables, a tensor per step built from padded Python lists, checks over each read range). The engine's
schedule + apply are timed too; the forward is not run (the tokens are drawn at random), so prompts of any
length cost nothing. With ``--device cuda`` it also runs whole steps on the GPU: ``launch`` (host time to
queue the forward and the sampling, eager or from CUDA graphs), ``collect`` (waiting), and the device time.

    PYTHONPATH=. python bench/step_overhead.py --worker [--device cuda] [--requests 64 256] [--steps 32]
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cluster.engine.engine import Engine, EngineConfig  # noqa: E402
from cluster.engine.build import build_engine  # noqa: E402
from cluster.engine.types import SamplingParams  # noqa: E402
from kvmanager.planning import kv_layout  # noqa: E402
from workers.sim.cost_model import StepCostModel  # noqa: E402
from workers.sim.presets import get_model_preset  # noqa: E402
from workers.sim.simulated import SimulatedWorker  # noqa: E402

MODEL, GPU, BLOCK = "gemma-3-27b", "H100-80GB", 16
PHASES = ("schedule", "encode", "apply", "decode", "execute")


class _Executor:
    def __init__(self, worker):
        self.worker = worker

    def execute(self, step):
        return self.worker.execute(step)


def engine_for(layout_name: str, num_requests: int, prompt_len: int, steps: int):
    """``per_kind``: the product (build_engine). ``split``: the previous layout, 1 group per S layers."""
    max_len = prompt_len + steps + num_requests // 4 + 64    # early requests decode while later ones prefill
    layout = kv_layout(get_model_preset(MODEL).layer_specs(BLOCK))
    # Simulated workers allocate nothing: room for every request decoding, and 16 at their prefill peak
    # (8 prompts a step, each holding its whole prompt's window until its first decode step).
    num_blocks = num_requests * layout.blocks_per_request(max_len) + 16 * layout.blocks_per_request(max_len, prompt_len)
    config = dict(max_model_len=max_len, max_num_batched_tokens=prompt_len * 8, max_num_seqs=num_requests)
    if layout_name == "per_kind":
        engine, _ = build_engine(MODEL, simulated_gpu=GPU, sleep_factor=0, block_size=BLOCK, num_blocks=num_blocks,
                                 **config)
        return engine
    specs = tuple(s for s, w in zip(layout.group_specs, layout.group_widths) for _ in range(w))
    preset = get_model_preset(MODEL)
    worker = SimulatedWorker(specs, num_blocks, vocab_size=preset.vocab_size, cost_model=StepCostModel(preset, GPU))
    return Engine(_Executor(worker), specs, num_blocks, EngineConfig(**config, vocab_size=preset.vocab_size))


def run(layout_name: str, num_requests: int, prompt_len: int, steps: int, seed: int) -> dict:
    from workers.wire import decode_step, encode_step   # msgpack: only this trace needs it
    engine = engine_for(layout_name, num_requests, prompt_len, steps)
    rng = random.Random(seed)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [rng.randrange(1, 32000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=engine.config.max_model_len - prompt_len - 1))
    while engine.scheduler.waiting or any(s.req.num_computed_tokens < s.req.num_tokens - 1
                                          for s in engine.scheduler.running):
        engine.step()                                  # prefill (and a first decode for the early ones)
    assert len(engine.scheduler.running) == num_requests, "every request must be decoding"
    totals = dict.fromkeys(PHASES, 0.0)
    host_steps = []
    table_ids = unit_ids = payload = 0
    gpu_s = 0.0
    worker = engine.executor.worker if hasattr(engine.executor, "worker") else engine.executor.workers[0]
    gc.collect()
    clock = time.process_time
    for _ in range(steps):
        t0 = clock()
        plan = engine.schedule()
        t1 = clock()
        wire = encode_step(plan.step)
        t2 = clock()
        step = decode_step(wire)
        t3 = clock()
        out = worker.execute(step)
        t4 = clock()
        engine.apply(plan, out)
        t5 = clock()
        for name, dt in zip(PHASES, (t1 - t0, t2 - t1, t5 - t4, t3 - t2, t4 - t3)):
            totals[name] += dt
        host_steps.append((t2 - t0) + (t5 - t4))
        table_ids += sum(len(ids) for c in plan.step.chunks for ids in c.new_block_ids)
        unit_ids += sum(len(units) for _, _, units in plan.step.compositions)
        payload += len(wire)
        gpu_s += out.simulated_time_s
        assert len(plan.step.chunks) == num_requests
    per_step = {k: v / steps * 1e3 for k, v in totals.items()}
    per_step["host"] = per_step["schedule"] + per_step["encode"] + per_step["apply"]
    per_step["host_p50"] = statistics.median(host_steps) * 1e3     # a typical step, no collector pass
    per_step.update(table_ids=table_ids / steps, unit_ids=unit_ids / steps, payload_bytes=payload / steps,
                    gpu_ms=gpu_s / steps * 1e3)
    return per_step


def run_churn(num_running: int, steps: int, warmup: int, seed: int) -> dict:
    """Turnover at a full pool: block ids per step in the deltas, table entries vs composed units."""
    rng = random.Random(seed)
    layout = kv_layout(get_model_preset(MODEL).layer_specs(BLOCK))
    max_len = 2048 + 256 + 16
    num_blocks = int(num_running * layout.blocks_per_request(max_len, 512) * 1.1)
    engine, _ = build_engine(MODEL, simulated_gpu=GPU, sleep_factor=0, block_size=BLOCK, num_blocks=num_blocks,
                             max_model_len=max_len, max_num_batched_tokens=2048, max_num_seqs=num_running)
    shared = [rng.randrange(1, 32000) for _ in range(512)]
    count = 0

    def arrive():
        nonlocal count
        n = rng.randrange(512, 2049)
        head = shared if rng.random() < 0.5 else []
        prompt = head + [rng.randrange(1, 32000) for _ in range(n - len(head))]
        engine.add_request(f"c{count}", prompt, SamplingParams(max_tokens=rng.randrange(16, 257)))
        count += 1

    for _ in range(num_running):
        arrive()
    table_ids = unit_ids = 0
    for step in range(warmup + steps):
        plan = engine.schedule()
        out = engine.executor.execute(plan.step)
        for update in engine.apply(plan, out):
            if update.finished:
                arrive()
        if step >= warmup:
            table_ids += sum(len(ids) for c in plan.step.chunks for ids in c.new_block_ids)
            unit_ids += sum(len(units) for _, _, units in plan.step.compositions)
    usage = engine.stats()["kv_usage"]
    return {"table_ids": table_ids / steps, "unit_ids": unit_ids / steps, "finished": count - num_running,
            "free_units": engine.manager.num_free_blocks, "usage": usage,
            "loose_units": sum(1 for e in engine.manager.pool.free.entries() if e.kind < 0)}


# -- the real worker's host side --------------------------------------------------------------------------
WORKER_PHASES = ("schedule", "check", "mirrors", "pack", "tables", "apply")


class LegacyPrep:
    """The previous worker's host side, kept here only to measure against: per-request list mirrors copied
    on every step, checks over each chunk's whole read range, tables built from padded Python lists."""

    def __init__(self, worker):
        self.w, self.tables, self.composed = worker, {}, {g: set() for g in worker._members}

    def check(self, step):
        from workers.protocol import check_chunk_fields, check_compositions
        w = self.w
        compositions = check_compositions(step.compositions, w.widths, w.num_blocks)
        tables, seen = {}, set()
        for c in step.chunks:
            check_chunk_fields(c, step.step_id, seen, len(w.groups), w.num_blocks, w.vocab_size)
            known = c.request_id in self.tables and c.request_id not in step.forget
            base = self.tables[c.request_id] if known else [[] for _ in w.groups]
            table = tables[c.request_id] = [old + list(new) for old, new in zip(base, c.new_block_ids)]
            need = -(-(c.start_pos + len(c.token_ids)) // w.block_size)
            for g, spec in enumerate(w.groups):
                read = table[g][spec.first_needed_token(c.start_pos) // w.block_size:need]
                assert 0 not in read
                if g in self.composed:
                    assert all(b in self.composed[g] or b in compositions.get(g, ()) for b in read)
        return tables, compositions

    def apply(self, step, tables, compositions):
        for rid in step.forget:
            del self.tables[rid]
        self.tables.update(tables)
        for g, composed in compositions.items():
            self.composed[g].update(composed)

    def lists(self, chunks):
        """The host part: per-request tensors and padded Python lists, each uploaded on its own."""
        import torch
        w, bs, dev = self.w, self.w.block_size, self.w.device
        query_lens = [len(c.token_ids) for c in chunks]
        seq_lens = [c.start_pos + n for c, n in zip(chunks, query_lens)]
        positions = torch.cat([torch.arange(c.start_pos, end) for c, end in zip(chunks, seq_lens)]).to(dev)
        seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(query_lens)).to(dev)
        width = max(-(-n // bs) for n in seq_lens)
        tables = []
        for g in range(len(w.groups)):
            rows = [self.tables[c.request_id][g][:-(-n // bs)] for c, n in zip(chunks, seq_lens)]
            tables.append(torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int32).to(dev))
        torch.tensor(seq_lens, dtype=torch.int32, device=dev), torch.tensor(query_lens, dtype=torch.int32, device=dev)
        return positions, seq_of_token, tables

    def gather(self, positions, seq_of_token, tables):
        """The device part: the same gathers as the new worker's ``tables`` phase."""
        w, bs = self.w, self.w.block_size
        out = []
        for g, table in enumerate(tables):
            table = w._members[g][table.long()].permute(2, 0, 1) if g in w._members else table[None]
            out.append(table[:, seq_of_token, positions // bs].long() * bs + positions % bs)
        return out


class PrepOnly:
    """An executor running the real worker's host side of each step (no forward) and the legacy one on the
    same steps, timing each phase; tokens are drawn at random."""

    def __init__(self, worker, clock, seed=0):
        import numpy as np
        self.w, self.legacy, self.clock, self.rng = worker, LegacyPrep(worker), clock, random.Random(seed)
        self.np = np
        self.times: dict[str, float] = {}
        self.timing = False

    def _add(self, name, dt):
        if self.timing:
            self.times[name] = self.times.get(name, 0.0) + dt

    def execute(self, step):
        from workers.protocol import StepOutput
        w, clock = self.w, self.clock
        t0 = clock()
        updates, compositions, fed = w._check(step, w._last_sampled)
        t1 = clock()
        for rid in step.forget:
            w.mirrors.forget(rid)
        w.mirrors.apply(updates, compositions)
        t2 = clock()
        rows = self.np.fromiter((w.mirrors.rows[c.request_id] for c in step.chunks), dtype=self.np.int64,
                                count=len(step.chunks))
        inputs = w.inputs.pack(step.chunks, rows, w.mirrors, fed=fed,
                               compositions={g: c for g, c in compositions.items() if g in w._members})
        for g, (ids, units) in inputs.compositions.items():
            w._members[g][ids.long()] = units
        t3 = clock()
        w._device_batch(inputs, inputs.logits_indices.long())
        _sync(w.device)
        t4 = clock()
        tables, legacy_compositions = self.legacy.check(step)
        self.legacy.apply(step, tables, legacy_compositions)
        t5 = clock()
        packed = self.legacy.lists(step.chunks)
        t6 = clock()
        self.legacy.gather(*packed)
        _sync(w.device)
        t7 = clock()
        for name, dt in (("check", t1 - t0), ("mirrors", t2 - t1), ("pack", t3 - t2), ("tables", t4 - t3),
                         ("legacy_check_mirrors", t5 - t4), ("legacy_lists", t6 - t5), ("legacy_tables", t7 - t6)):
            self._add(name, dt)
        return StepOutput(step.step_id, {c.request_id: self.rng.randrange(1, w.vocab_size)
                                         for c in step.chunks if c.sample})


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def _model_shape(device: str) -> dict:
    from e2e_gpu import GEMMA3_1B
    if device == "cuda":
        return GEMMA3_1B
    # the layout of the real model (26 layers, 5 sliding : 1 full, one KV head), tiny widths
    return {**GEMMA3_1B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 64, "head_dim": 32}


def worker_engine(num_requests: int, prompt_len: int, steps: int, device: str, cuda_graphs=False, executor=None):
    import torch
    from e2e_gpu import build_model
    model = build_model(_model_shape(device), torch.bfloat16 if device == "cuda" else torch.float32, device)
    max_len = prompt_len + steps + num_requests // 4 + 64     # early requests decode while later ones prefill
    layout = kv_layout(build_engine_layout_specs(model))
    # room for every request decoding, and 16 at their prefill peak (as ``engine_for`` sizes it)
    num_blocks = num_requests * layout.blocks_per_request(max_len) + 16 * layout.blocks_per_request(max_len, prompt_len)
    engine, _ = build_engine(model, block_size=BLOCK, num_blocks=num_blocks, max_model_len=max_len,
                             max_num_batched_tokens=prompt_len * 8, max_num_seqs=num_requests,
                             cuda_graphs=cuda_graphs)
    return engine


def build_engine_layout_specs(model):
    from workers.models.layer_kinds import layer_specs
    return layer_specs(model.config.get_text_config(), BLOCK)


def prefill(engine, num_requests, prompt_len, vocab, seed=0):
    rng = random.Random(seed)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [rng.randrange(1, vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=engine.config.max_model_len - prompt_len - 1))
    while engine.scheduler.waiting or any(s.req.num_computed_tokens < s.req.num_tokens - 1
                                          for s in engine.scheduler.running):
        engine.step()


def run_worker_prep(num_requests: int, prompt_len: int, steps: int, device: str) -> dict:
    """Host time per decode step of the real worker's input side, new and legacy, and the engine's."""
    engine = worker_engine(num_requests, prompt_len, steps, device)
    worker = engine.executor.workers[0]
    clock = time.perf_counter if device == "cuda" else time.process_time
    prep = PrepOnly(worker, clock)
    engine.executor = prep
    prefill(engine, num_requests, prompt_len, worker.vocab_size)
    prep.timing = True
    gc.collect()
    sched = appl = 0.0
    for _ in range(steps):
        t0 = clock()
        plan = engine.schedule()
        t1 = clock()
        out = prep.execute(plan.step)
        t2 = clock()
        engine.apply(plan, out)
        t3 = clock()
        sched, appl = sched + t1 - t0, appl + t3 - t2
        assert len(plan.step.chunks) == num_requests
    r = {k: v / steps * 1e3 for k, v in prep.times.items()}
    r.update(schedule=sched / steps * 1e3, apply=appl / steps * 1e3)
    r["host"] = r["check"] + r["mirrors"] + r["pack"]
    r["legacy_host"] = r["legacy_check_mirrors"] + r["legacy_lists"]
    return r


def run_worker_gpu(num_requests: int, prompt_len: int, steps: int, cuda_graphs: bool) -> dict:
    """Whole decode steps on the GPU, one at a time: host time to launch, time waiting, device time."""
    import torch
    engine = worker_engine(num_requests, prompt_len, steps, "cuda", cuda_graphs=cuda_graphs)
    worker = engine.executor.workers[0]
    if cuda_graphs:
        worker.capture_graphs([num_requests], engine.config.max_model_len)
    prefill(engine, num_requests, prompt_len, worker.vocab_size)
    for _ in range(4):
        engine.step()                            # warm: compile the decode kernels at this batch
    launch = collect = device = 0.0
    for _ in range(steps):
        plan = engine.schedule()
        t0 = time.perf_counter()
        pending = worker.launch(plan.step)
        t1 = time.perf_counter()
        out = worker.collect(pending)
        t2 = time.perf_counter()
        engine.apply(plan, out)
        launch, collect, device = launch + t1 - t0, collect + t2 - t1, device + out.device_time_s
    result = {"launch": launch / steps * 1e3, "collect": collect / steps * 1e3, "device": device / steps * 1e3,
              "replays": worker.graphs.replays if worker.graphs else 0}
    del engine, worker
    gc.collect()
    torch.cuda.empty_cache()
    return result


def worker_main(args) -> None:
    import json

    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    device = args.device
    if device == "cpu":
        torch.set_num_threads(1)     # the CPU stands in for the device: one thread keeps OpenMP wake-ups out
    print(f"\nreal worker, random Gemma-3-1B-shaped model ({'full widths' if device == 'cuda' else 'tiny widths'}, "
          f"26 layers, 5 sliding W=512 : 1 full), {device}: ms per decode step, prompt {args.prompt_len}, "
          f"block {BLOCK}, {args.steps} steps ({'wall' if device == 'cuda' else 'CPU'} time)")
    cols = ("schedule", "check", "mirrors", "pack", "host", "legacy_check_mirrors", "legacy_lists", "legacy_host",
            "tables", "legacy_tables", "apply")
    print("host = check + mirrors + pack (the worker's Python side); tables = the device ops building unit tables "
          "and slots (on CPU, computed by the CPU, one thread)")
    print(f"{'running':>8}" + "".join(f"{c:>21}" for c in cols) + f"{'legacy/new host':>17}")
    rows = []
    for n in args.requests:
        r = run_worker_prep(n, args.prompt_len, args.steps, device)
        rows.append({"kind": "worker_prep", "device": device, "running": n, **r})
        print(f"{n:>8}" + "".join(f"{r[c]:>21.3f}" for c in cols) + f"{r['legacy_host'] / r['host']:>17.1f}")
    if device == "cuda":
        print("\nwhole decode steps on the GPU, one at a time (ms per step, wall): launch = host time to queue "
              "the step, collect = waiting for its tokens, device = CUDA events around its work")
        print(f"{'running':>8}{'graphs':>8}{'launch':>10}{'collect':>10}{'device':>10}{'launch/device':>15}")
        for n in args.requests:
            for graphs in (False, True):
                r = run_worker_gpu(n, args.prompt_len, args.steps, graphs)
                rows.append({"kind": "worker_gpu", "running": n, "graphs": graphs, **r})
                print(f"{n:>8}{str(graphs):>8}{r['launch']:>10.3f}{r['collect']:>10.3f}{r['device']:>10.3f}"
                      f"{r['launch'] / max(r['device'], 1e-9):>15.2f}")
    if args.out:
        with open(args.out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=None)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--churn", action="store_true", help="also the turnover trace (block ids per step only)")
    ap.add_argument("--worker", action="store_true", help="the real worker's host side instead (see above)")
    ap.add_argument("--device", default="cpu", help="with --worker: cpu or cuda")
    ap.add_argument("--out", help="with --worker: JSON lines here")
    args = ap.parse_args()
    if args.worker:
        args.requests = args.requests or [64, 256]
        args.steps = args.steps or 32
        worker_main(args)
        return
    args.requests = args.requests or [64, 256, 1024]
    args.steps = args.steps or 64
    layouts = ("per_kind", "split")
    best: dict = {}
    for rnd in range(args.rounds):
        for n in args.requests:
            for name in layouts:
                r = run(name, n, args.prompt_len, args.steps, seed=rnd)
                key = (name, n)
                if key not in best or r["host"] + r["execute"] < best[key]["host"] + best[key]["execute"]:
                    best[key] = r
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)

    print(f"\n{MODEL} on simulated {GPU}: ms of CPU per decode step (prompt {args.prompt_len}, block {BLOCK}, "
          f"{args.steps} steps, best of {args.rounds} rounds)")
    print("per_kind: one group per attention kind (sliding 26 units wide, full 5); split: 26 + 5 groups of width 1")
    cols = ("schedule", "encode", "apply", "host", "host_p50", "decode", "execute", "table_ids", "unit_ids",
            "payload_bytes", "gpu_ms")
    print(f"{'layout':<9}{'running':>8}" + "".join(f"{c:>14}" for c in cols))
    for n in args.requests:
        for name in layouts:
            r = best[(name, n)]
            print(f"{name:<9}{n:>8}" + "".join(f"{r[c]:>14.2f}" if c not in ("table_ids", "unit_ids", "payload_bytes")
                                               else f"{r[c]:>14.1f}" for c in cols))
    print("\nratios (split / per_kind), and host time as a share of the modelled GPU step:")
    for n in args.requests:
        a, b = best[("per_kind", n)], best[("split", n)]
        print(f"  {n:>5} running: host {b['host'] / a['host']:.1f}x, execute {b['execute'] / a['execute']:.1f}x, "
              f"payload {b['payload_bytes'] / a['payload_bytes']:.1f}x; per_kind host = "
              f"{a['host'] / a['gpu_ms']:.1%} of the GPU step ({a['gpu_ms']:.1f} ms)")
    if args.churn:
        r = run_churn(64, steps=1000, warmup=2000, seed=0)
        print(f"\nturnover, 64 running, pool 1.1x their need, steps 2000..3000 ({r['finished']} requests finished "
              f"by then): {r['table_ids']:.1f} table ids + {r['unit_ids']:.1f} composed units per step")


if __name__ == "__main__":
    main()
