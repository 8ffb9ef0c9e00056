"""Sampling cost per step: the batched sampler vs a per-row loop (softmax + multinomial per request, one
generator each, as the worker sampled before), side by side on the same logits.

    PYTHONPATH=. python bench/sampling.py [--vocab 32000] [--device cpu]
"""
from __future__ import annotations

import argparse
import time

import torch

from workers.protocol import RequestStart, SamplingSpec, ScheduledChunk
from workers.runtime.sampling import Sampler, draw_seed


def per_row(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[int]:
    tokens = logits.argmax(dim=-1).tolist()
    for i, c in enumerate(chunks):
        spec = c.start.sampling
        if not spec.greedy:
            generator = torch.Generator(device=logits.device)
            generator.manual_seed(draw_seed(spec.seed or 0, c.start_pos + len(c.token_ids)))
            probs = torch.softmax(logits[i].float() / spec.temperature, dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=generator))
    return tokens


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"vocab {args.vocab}, {args.device}; ms per step, mean of {args.repeats}")
    print(f"{'batch':>5} {'mix':<28} {'per-row':>9} {'batched':>9} {'ratio':>6}")
    for batch in (8, 64, 256):
        logits = torch.randn(batch, args.vocab, device=args.device) * 3
        for mix, spec_of in (("temperature 0.8, unseeded", lambda i: SamplingSpec(temperature=0.8)),
                             ("temperature 0.8, half seeded", lambda i: SamplingSpec(temperature=0.8,
                                                                                      seed=i if i % 2 else None)),
                             ("greedy", lambda i: SamplingSpec())):
            chunks = [ScheduledChunk(f"r{i}", [1], 100, [[]], start=RequestStart(spec_of(i), 50)) for i in range(batch)]
            sampler = Sampler(args.vocab, args.device)
            sampler.observe(chunks)
            loop = timed(lambda: per_row(logits, chunks), args.repeats)
            vec = timed(lambda: sampler.sample(logits, chunks), args.repeats)
            print(f"{batch:>5} {mix:<28} {loop:>9.2f} {vec:>9.2f} {loop / vec:>5.1f}x")


if __name__ == "__main__":
    main()
