"""Sampling on the last pipeline stage: every request of a step in one batched torch pass.

Order of application, as vLLM's v1 sampler does it (so a client moving between the two gets the same
distribution): logits in float32; logprobs, when asked, are the **raw** log-softmax of the model's
logits (vLLM's default ``raw_logprobs``: before bias, penalties, temperature and truncation); then
``logit_bias`` is added; then the penalties: repetition (over prompt and output: positive logits
divided, negative multiplied), frequency (minus penalty x count in the output), presence (minus
penalty once per token present in the output). Greedy rows (temperature < 1e-5) take the argmax here;
the others are divided by their temperature, then ``min_p`` (drop tokens whose probability is below
``min_p`` x the top one's), ``top_k``, ``top_p`` (the smallest set, most likely first, whose mass
reaches ``top_p``), and are drawn by inverse CDF: one uniform number per row, located in the row's
cumulative distribution (float64) by ``searchsorted``. One number per row instead of one per token
(vLLM's exponential race) keeps the draw cheap where random numbers are dear (on CPU an exponential
per token costs about three cumulative sums), and nothing waits on the host either way.

Randomness: rows with a seed draw their number from a generator seeded by (seed, position of the new
token), so a replay after preemption, recompute or a worker restart draws the same token; rows
without one share the worker's batch generator (one call for all of them).

Penalty state lives here too: per request with penalties, one row of a pooled [rows, vocab] table of
output counts and one of prompt presence, updated from each step's chunk tokens by one scatter.
"""
from __future__ import annotations

import random

import torch

from .protocol import GREEDY, ScheduledChunk, SamplingSpec

_MIX = 0x9E3779B97F4A7C15   # golden-ratio multiplier: nearby (seed, position) pairs give unrelated seeds


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at ``position``."""
    return (seed * _MIX + position) % 2**64


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.specs: dict[str, SamplingSpec] = {}
        self.num_prompt_tokens: dict[str, int] = {}
        self.rows: dict[str, int] = {}                 # request -> row of the penalty tables
        self._free_rows: list[int] = []
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(random.SystemRandom().getrandbits(63))   # unseeded: the worker's own

    # -- per-request state ---------------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        self.specs.pop(request_id, None)
        self.num_prompt_tokens.pop(request_id, None)
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.output_counts[row] = 0
            self.prompt_seen[row] = False
            self._free_rows.append(row)

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        """Take in a (checked) step: new requests' specs, then every penalised request's new tokens."""
        prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
        for chunk in chunks:
            rid = chunk.request_id
            tokens, first = chunk.token_ids, chunk.start_pos
            if chunk.start is not None:
                spec = chunk.start.sampling
                self.specs[rid] = spec
                self.num_prompt_tokens[rid] = chunk.start.num_prompt_tokens
                if spec.has_penalties:
                    self.rows[rid] = self._new_row()
                    tokens = chunk.start.seen_token_ids + tokens
                    first -= len(chunk.start.seen_token_ids)
            row = self.rows.get(rid)
            if row is None:
                continue
            split = min(max(self.num_prompt_tokens[rid] - first, 0), len(tokens))
            prompt_rows += [row] * split
            prompt_ids += tokens[:split]
            output_rows += [row] * (len(tokens) - split)
            output_ids += tokens[split:]
        if prompt_ids:
            self.prompt_seen[self._long(prompt_rows), self._long(prompt_ids)] = True
        if output_ids:
            self.output_counts.index_put_((self._long(output_rows), self._long(output_ids)),
                                          torch.ones(len(output_ids), dtype=torch.int32, device=self.device),
                                          accumulate=True)

    def _new_row(self) -> int:
        if not self._free_rows:
            n = self.output_counts.shape[0]
            grow = max(n, 8)
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(grow, self.vocab_size)])
            self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(grow, self.vocab_size)])
            self._free_rows = list(range(n + grow - 1, n - 1, -1))
        return self._free_rows.pop()

    def _long(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _float(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    # -- the batched pass ----------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]):
        """Next token of each sampling chunk (rows of ``logits`` in order) and, per request that asked,
        (raw logprob of its token, top token ids, their raw logprobs)."""
        if not chunks:
            return [], {}
        specs = [self.specs.get(c.request_id, GREEDY) for c in chunks]
        logits = logits.float()
        asked = [i for i, s in enumerate(specs) if s.logprobs is not None]
        raw = torch.log_softmax(logits[asked], dim=-1) if asked else None
        x = self.adjusted_logits(logits, chunks, specs)
        greedy = [i for i, s in enumerate(specs) if s.greedy]
        drawn = [i for i, s in enumerate(specs) if not s.greedy]
        if not drawn:
            tokens = x.argmax(dim=-1)
        else:
            tokens = torch.empty(len(specs), dtype=torch.long, device=x.device)
        if greedy and drawn:
            tokens[greedy] = x[greedy].argmax(dim=-1)
        if drawn:
            probs = self.probabilities(x if len(drawn) == len(specs) else x[drawn], [specs[i] for i in drawn])
            tokens[drawn] = self.draw(probs, [chunks[i] for i in drawn], [specs[i] for i in drawn])
        token_list = tokens.tolist()
        return token_list, (self._logprobs(raw, tokens[asked], [specs[i] for i in asked],
                                           [chunks[i].request_id for i in asked]) if asked else {})

    def adjusted_logits(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
                        specs: list[SamplingSpec]) -> torch.Tensor:
        """float32 logits after ``logit_bias`` and the penalties (a copy when anything changes)."""
        bias = [(i, t, b) for i, s in enumerate(specs) for t, b in s.logit_bias]
        penalised = [i for i, s in enumerate(specs) if s.has_penalties and chunks[i].request_id in self.rows]
        if not bias and not penalised:
            return logits
        x = logits.clone()
        if bias:
            rows, ids, values = zip(*bias)
            x.index_put_((self._long(rows), self._long(ids)), self._float(values), accumulate=True)
        if penalised:
            table_rows = self._long([self.rows[chunks[i].request_id] for i in penalised])
            counts = self.output_counts[table_rows].float()
            present = counts > 0
            seen = self.prompt_seen[table_rows] | present
            rep = self._float([specs[i].repetition_penalty for i in penalised])[:, None]
            freq = self._float([specs[i].frequency_penalty for i in penalised])[:, None]
            pres = self._float([specs[i].presence_penalty for i in penalised])[:, None]
            rows = self._long(penalised)
            y = x[rows]
            y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
            x[rows] = y - freq * counts - pres * present.float()
        return x

    def probabilities(self, x: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
        """The distribution each non-greedy row draws from: temperature, min_p, top_k, top_p."""
        x = x / self._float([s.temperature for s in specs])[:, None]
        vocab = x.shape[1]
        min_p = [s.min_p for s in specs]
        if any(min_p):
            probs = torch.softmax(x, dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * self._float(min_p)[:, None]
            x = x.masked_fill(probs < floor, float("-inf"))
        top_k = [s.top_k if 0 < s.top_k < vocab else vocab for s in specs]
        top_p = [s.top_p for s in specs]
        if min(top_k) < vocab or min(top_p) < 1.0:
            ordered, order = x.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=x.device)[None, :]
            drop = ranks >= self._long(top_k)[:, None]
            if min(top_p) < 1.0:
                p = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
                before = p.cumsum(dim=-1) - p                  # mass of the more likely tokens
                drop |= before >= self._float(top_p)[:, None]
                drop[:, 0] = False                             # the most likely token always stays
            x = torch.full_like(x, float("-inf")).scatter(1, order, ordered.masked_fill(drop, float("-inf")))
        return torch.softmax(x, dim=-1)

    def draw(self, probs: torch.Tensor, chunks: list[ScheduledChunk], specs: list[SamplingSpec]) -> torch.Tensor:
        """One token per row, drawn from its distribution with a single uniform number."""
        u = torch.empty(len(specs), 1, device=probs.device)
        unseeded = [i for i, s in enumerate(specs) if s.seed is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), 1, generator=self.generator, device=probs.device)
        for i, spec in enumerate(specs):
            if spec.seed is not None:
                c = chunks[i]
                generator = torch.Generator(device=probs.device)
                generator.manual_seed(draw_seed(spec.seed, c.start_pos + len(c.token_ids)))
                u[i] = torch.rand(1, generator=generator, device=probs.device)
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        # 1 - u lies in (0, 1]: the point is > 0, so a leading zero-probability token is never picked
        point = (1.0 - u.double()) * cdf[:, -1:]
        return torch.searchsorted(cdf, point)[:, 0].clamp_(max=probs.shape[1] - 1)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, specs: list[SamplingSpec], request_ids: list[str]):
        chosen = raw.gather(1, tokens[:, None])[:, 0].tolist()
        k = max(s.logprobs for s in specs)
        top_values, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        return {rid: (chosen[j], top_ids[j][:s.logprobs], top_values[j][:s.logprobs])
                for j, (rid, s) in enumerate(zip(request_ids, specs))}
