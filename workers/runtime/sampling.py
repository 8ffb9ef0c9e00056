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

Prompt logprobs (``score_prompts``) are raw log-softmax too, one row per prompt position of a chunk;
the row scoring a chunk's first token is the previous chunk's last, kept here (``_tails``, on the
device) until that token arrives.

Penalty state lives here too: per request with penalties, one row of a pooled [rows, vocab] table of
output counts and one of prompt presence, updated from each step's chunk tokens by one scatter.

Nothing here waits on the device until the step's results are read: small host lists reach a CUDA device
through pinned memory without blocking (a plain upload would first wait for the whole forward), and
``sample_async`` leaves the draws on the device, with their copies to pinned host memory queued behind
them (``Sampled``). So a worker can queue step N+1 before reading step N's tokens, and feed step N's
tokens, still on the device, into step N+1's inputs.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from workers.protocol import GREEDY, ScheduledChunk, SamplingSpec

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
        # request -> (prompt position its row scores, that row's raw log-softmax): a chunk's last prompt row,
        # waiting for the next chunk's first token
        self._tails: dict[str, tuple[int, torch.Tensor]] = {}
        self.scoring: set[str] = set()                 # requests asking for prompt logprobs

    # -- per-request state ---------------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        self.specs.pop(request_id, None)
        self._tails.pop(request_id, None)
        self.scoring.discard(request_id)
        self.num_prompt_tokens.pop(request_id, None)
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.output_counts[row] = 0
            self.prompt_seen[row] = False
            self._free_rows.append(row)

    def observe(self, chunks: list[ScheduledChunk], packed_ids: torch.Tensor | None = None) -> None:
        """Take in a (checked) step: new requests' specs, then every penalised request's new tokens.

        ``packed_ids``: the step's input ids on the device, chunks concatenated in order. When given, the
        penalties count those (a chunk fed by the previous step's draw holds only a placeholder on the
        host); otherwise the chunks' ``token_ids``. Tokens are prompt below the request's prompt length."""
        host = ([], [], [], [])       # prompt rows, prompt ids, output rows, output ids (ids known here)
        packed = ([], [], [], [])     # the same, with positions in packed_ids instead of ids
        offset = 0
        for chunk in chunks:
            rid, n = chunk.request_id, len(chunk.token_ids)
            offset += n
            seen = []
            if chunk.start is not None:
                spec = chunk.start.sampling
                self.specs[rid] = spec
                self.num_prompt_tokens[rid] = chunk.start.num_prompt_tokens
                if spec.prompt_logprobs is not None:
                    self.scoring.add(rid)
                if spec.has_penalties:
                    self.rows[rid] = self._new_row()
                    seen = chunk.start.seen_token_ids
            row = self.rows.get(rid)
            if row is None:
                continue
            # The run seen + own tokens starts at position start_pos - len(seen); its first `split` are prompt.
            split = min(max(self.num_prompt_tokens[rid] - (chunk.start_pos - len(seen)), 0), len(seen) + n)
            own = chunk.token_ids if packed_ids is None else range(offset - n, offset)
            for target, values, cut in ((host, seen, min(split, len(seen))),
                                        (host if packed_ids is None else packed, own, max(split - len(seen), 0))):
                target[0].extend([row] * min(cut, len(values)))
                target[1].extend(values[:cut])
                target[2].extend([row] * (len(values) - min(cut, len(values))))
                target[3].extend(values[cut:])
        for seen_table, rows, ids, at_rows, at in ((self.prompt_seen, host[0], host[1], packed[0], packed[1]),
                                                   (self.output_counts, host[2], host[3], packed[2], packed[3])):
            if not ids and not at:
                continue
            rows_t = self._long(rows + at_rows)
            ids_t = self._long(ids)
            if at:
                ids_t = torch.cat([ids_t, packed_ids[self._long(at)].long()])
            if seen_table is self.prompt_seen:
                self.prompt_seen[rows_t, ids_t] = True
            else:
                self.output_counts.index_put_((rows_t, ids_t), torch.ones_like(rows_t, dtype=torch.int32),
                                              accumulate=True)

    def _new_row(self) -> int:
        if not self._free_rows:
            n = self.output_counts.shape[0]
            grow = max(n, 8)
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(grow, self.vocab_size)])
            self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(grow, self.vocab_size)])
            self._free_rows = list(range(n + grow - 1, n - 1, -1))
        return self._free_rows.pop()

    def _long(self, values) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.long), self.device)

    def _float(self, values) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.float32), self.device)

    # -- the batched pass ----------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]):
        """Next token of each sampling chunk (rows of ``logits`` in order; -1 for a row holding NaN, whose
        request must fail) and, per request that asked, (raw logprob of its token, top token ids, their raw
        logprobs). Waits for the device: ``sample_async`` does not."""
        return self.sample_async(logits, chunks).result()

    def sample_async(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
                     prompt: tuple[torch.Tensor, "PromptPlan"] | None = None) -> "Sampled":
        """The draws of ``sample``, left on the device with their copies to the host queued (no sync).
        ``prompt``: the logits of the step's prompt rows and their plan (``prompt_plan``), to score."""
        scored, prompt_asks = self.score_prompts(*prompt) if prompt is not None else ({}, [])
        if not chunks:
            return Sampled([], None, scored, [], prompt_asks)
        specs = [self.specs.get(c.request_id, GREEDY) for c in chunks]
        logits = logits.float()
        broken = logits.isnan().any(dim=-1)   # a row the model broke: its request fails (token -1)
        asked = [i for i, s in enumerate(specs) if s.logprobs is not None]
        asked_t = self._long(asked) if asked and len(asked) < len(specs) else None
        raw = None
        if asked:
            raw = torch.log_softmax(logits if asked_t is None else logits[asked_t], dim=-1)
        x = self.adjusted_logits(logits, chunks, specs)
        drawn = [i for i, s in enumerate(specs) if not s.greedy]
        if not drawn:
            tokens = x.argmax(dim=-1)
        elif len(drawn) == len(specs):
            probs = self.probabilities(x, specs)
            broken |= probs.isnan().any(dim=-1)   # e.g. +inf logits: no distribution to draw from
            tokens = self.draw(probs, chunks, specs)
        else:
            greedy_t = self._long([i for i, s in enumerate(specs) if s.greedy])
            drawn_t = self._long(drawn)
            tokens = torch.empty(len(specs), dtype=torch.long, device=x.device)
            tokens[greedy_t] = x[greedy_t].argmax(dim=-1)
            probs = self.probabilities(x[drawn_t], [specs[i] for i in drawn])
            broken[drawn_t] |= probs.isnan().any(dim=-1)
            tokens[drawn_t] = self.draw(probs, [chunks[i] for i in drawn], [specs[i] for i in drawn])
        results = {"tokens": torch.where(broken, -1, tokens)}
        if asked:
            chosen_tokens = tokens if asked_t is None else tokens[asked_t]
            results["chosen"] = raw.gather(1, chosen_tokens[:, None])[:, 0]
            k = max(specs[i].logprobs for i in asked)
            if k:
                results["top_values"], results["top_ids"] = raw.topk(k, dim=-1)
        logprob_asks = [(chunks[i].request_id, specs[i].logprobs) for i in asked]
        results.update(scored)
        return Sampled([c.request_id for c in chunks], tokens, results, logprob_asks, prompt_asks)

    # -- prompt logprobs -------------------------------------------------------------------------
    def scores_prompts(self, chunks: list[ScheduledChunk]) -> bool:
        """A request of the step may ask for prompt logprobs: one known here does, or a new one's spec does."""
        return bool(self.scoring) or any(c.start is not None and c.start.sampling.prompt_logprobs is not None
                                         for c in chunks)

    def prompt_plan(self, chunks: list[ScheduledChunk]) -> "PromptPlan | None":
        """Which rows of the step's packed tokens score prompt tokens (None: no chunk asks). Call after
        ``observe`` (which learns new requests' specs). Row ``p`` of a chunk scores token ``p + 1``."""
        rows: list[int] = []
        asks = []
        offset = 0
        for chunk in chunks:
            rid, n = chunk.request_id, len(chunk.token_ids)
            if rid in self.scoring:
                s = chunk.start_pos
                count = max(min(s + n, self.num_prompt_tokens[rid] - 1) - s, 0)
                if count or rid in self._tails:
                    asks.append((chunk, len(rows), count))
                    rows.extend(range(offset, offset + count))
            offset += n
        return PromptPlan(rows, asks) if asks else None

    def score_prompts(self, logits: torch.Tensor, plan: "PromptPlan") -> tuple[dict, list]:
        """Raw logprob (and top k) of each prompt token the plan's rows (``logits``, in plan order) and the
        kept tails score; result tensors on the device, and per request (id, first position, count, k)."""
        raw = torch.log_softmax(logits.float(), dim=-1) if len(plan.rows) else None
        tails: list[torch.Tensor] = []
        picks: list[tuple[bool, int]] = []    # (from the tails, index)
        targets: list[int] = []
        asks = []
        for chunk, first, count in plan.asks:
            rid, s, n = chunk.request_id, chunk.start_pos, len(chunk.token_ids)
            number = 0
            tail = self._tails.pop(rid, None)
            if tail is not None and tail[0] == s:   # the previous chunk's last row scores this chunk's first token
                picks.append((True, len(tails)))
                tails.append(tail[1])
                targets.append(chunk.token_ids[0])
                number += 1
            inside = min(count, n - 1)           # rows whose token is in this chunk
            picks += [(False, first + j) for j in range(inside)]
            targets += chunk.token_ids[1:1 + inside]
            number += inside
            if count > inside:                   # its token is the next chunk's first: keep the row
                self._tails[rid] = (s + n, raw[first + count - 1].clone())
            if number:
                asks.append((rid, s if number > inside else s + 1, number, self.specs[rid].prompt_logprobs))
        if not asks:
            return {}, []
        if tails:
            stack = torch.cat([torch.stack(tails)] + ([raw] if raw is not None else []))
            index = [i if from_tails else len(tails) + i for from_tails, i in picks]
        else:
            stack, index = raw, [i for _, i in picks]
        chosen_rows = stack[self._long(index)]
        results = {"prompt_chosen": chosen_rows.gather(1, self._long(targets)[:, None])[:, 0]}
        k = max(a[3] for a in asks)
        if k:
            results["prompt_top_values"], results["prompt_top_ids"] = chosen_rows.topk(k, dim=-1)
        return results, asks

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
        if len(unseeded) == len(specs):
            u = torch.rand(len(specs), 1, generator=self.generator, device=probs.device)
        elif unseeded:
            u[self._long(unseeded)] = torch.rand(len(unseeded), 1, generator=self.generator, device=probs.device)
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


@dataclass
class PromptPlan:
    """The rows of a step that score prompt tokens: ``rows`` (indices in the packed step), and per chunk
    that asks (chunk, its first entry in ``rows``, how many rows it has)."""

    rows: list[int]
    asks: list[tuple[ScheduledChunk, int, int]]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device``; to CUDA through pinned memory, so nothing waits for the device."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Sampled:
    """One step's draws: ``tokens`` stays on the device (the next step's inputs for fed chunks; a broken
    row's draw is still a valid id there), the results travel to pinned host memory behind the draws.
    ``result()`` waits for them alone: later steps queued on the device meanwhile do not delay it."""

    def __init__(self, request_ids: list[str], tokens: torch.Tensor | None, results: dict[str, torch.Tensor],
                 logprob_asks: list[tuple[str, int]], prompt_asks: list[tuple[str, int, int, int]] = ()):
        self.index = {rid: i for i, rid in enumerate(request_ids)}   # request -> its row of tokens
        self.request_ids = request_ids
        self.tokens = tokens
        self._asks = logprob_asks
        self._prompt_asks = prompt_asks
        self._event = None
        if results and next(iter(results.values())).is_cuda:
            host = {}
            for name, t in results.items():
                host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[name].copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            results = host
        self._results = results

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def prompt_result(self) -> dict[str, tuple[int, list[float], list[list[int]], list[list[float]]]]:
        """Per request scored: (first prompt position, logprobs, top ids, top logprobs) (``StepOutput``)."""
        if not self._prompt_asks:
            return {}
        if self._event is not None:
            self._event.synchronize()
        r = self._results
        chosen = r["prompt_chosen"].tolist()
        top_ids = r["prompt_top_ids"].tolist() if "prompt_top_ids" in r else [[] for _ in chosen]
        top_values = r["prompt_top_values"].tolist() if "prompt_top_values" in r else [[] for _ in chosen]
        out, at = {}, 0
        for rid, start, number, k in self._prompt_asks:
            rows = range(at, at + number)
            out[rid] = (start, chosen[at:at + number], [top_ids[i][:k] for i in rows], [top_values[i][:k] for i in rows])
            at += number
        return out

    def result(self) -> tuple[list[int], dict]:
        """(token per row, -1 where the row broke; per request that asked, its logprobs entry)."""
        if not self.request_ids:
            return [], {}
        if self._event is not None:
            self._event.synchronize()
        r = self._results
        token_list = r["tokens"].tolist()
        if not self._asks:
            return token_list, {}
        chosen = r["chosen"].tolist()
        top_values = r["top_values"].tolist() if "top_values" in r else [[] for _ in chosen]
        top_ids = r["top_ids"].tolist() if "top_ids" in r else [[] for _ in chosen]
        return token_list, {rid: (chosen[j], top_ids[j][:k], top_values[j][:k])
                            for j, (rid, k) in enumerate(self._asks)}
