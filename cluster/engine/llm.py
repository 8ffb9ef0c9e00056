"""The offline ``LLM`` facade: batch generation in this process over ``build_engine``'s engine."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .args import EngineArgs
from .build import build_engine
from .types import SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str                   # length | stop | error
    text: str | None = None
    error: str | None = None             # why, when finish_reason is "error"
    # with prompt_logprobs: None for position 0, then (raw logprob, top ids, top logprobs) per prompt token
    prompt_logprobs: list | None = None


class LLM:
    """Offline batch generation: ``LLM(model).generate([[1, 2, 3], ...], max_tokens=32)``. Greedy by default."""

    def __init__(self, model: EngineArgs | Any = "default", **engine_args):
        """``model``: a model (``EngineArgs.model``) followed by ``EngineArgs``' other fields as keywords
        (``tensor_parallel_size=1, pipeline_parallel_size=1, block_size=16, num_blocks=None,
        max_num_batched_tokens=512, enable_prefix_caching=True, ...``), or an ``EngineArgs``."""
        self.args = model.replace(**engine_args) if isinstance(model, EngineArgs) else \
            EngineArgs(model=model, **engine_args)
        self.engine, self.info = build_engine(self.args)
        self._tokenizer = None
        self._counter = 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from .tokenizer import load_tokenizer
            path = self.info["model_path"]
            self._tokenizer = load_tokenizer(path if os.path.isdir(path) else None)
        return self._tokenizer

    def generate(self, prompts, max_tokens: int = 32, temperature: float = 0.0, seed: int | None = None,
                 stop_token_ids=(), ignore_eos: bool = False, use_tqdm: bool = False,
                 prompt_logprobs: int | None = None) -> list[CompletionOutput]:
        """Prompts: lists of token ids, or strings (tokenized with the model's tokenizer).

        Generation stops at the model's EOS (``generation_config.json`` / config ``eos_token_id``, kept in
        the output as transformers does) unless ``ignore_eos``, or at ``stop_token_ids``. Without a
        ``seed`` every request draws its own randomness; with one, every request samples with that seed
        (as vLLM's ``SamplingParams.seed``), so results are reproducible. ``prompt_logprobs=k`` scores each
        prompt token (its raw logprob given the tokens before it, and the top k); with ``max_tokens=0`` the
        prompt is only scored."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of prompts (strings or lists of token ids)")
        stop = tuple(stop_token_ids) + (() if ignore_eos else tuple(self.info.get("eos_token_ids", ())))
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                stop_token_ids=tuple(dict.fromkeys(stop)), prompt_logprobs=prompt_logprobs)
        texts = [isinstance(p, str) for p in prompts]
        token_prompts = [self.tokenizer.encode(p) if t else list(p) for p, t in zip(prompts, texts)]
        ids = []
        for tokens in token_prompts:   # all validated and queued, or none (the first bad one raises)
            ids.append(f"llm-{self._counter}")
            self._counter += 1
        added = []
        try:
            for rid, tokens in zip(ids, token_prompts):
                self.engine.add_request(rid, tokens, params)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        outputs = {rid: [] for rid in ids}
        scored = {rid: [None] for rid in ids}
        reasons, errors = {}, {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm
            progress = tqdm(total=len(ids), desc="generate", unit="req")
        while len(reasons) < len(ids):
            if not self.engine.has_work():
                raise RuntimeError("engine went idle with unfinished requests")  # never expected
            for update in self.engine.step():
                if update.request_id in outputs:
                    outputs[update.request_id].extend(update.new_token_ids)
                    scored[update.request_id].extend(update.prompt_logprobs or ())
                    if update.finished:
                        reasons[update.request_id] = update.finish_reason
                        errors[update.request_id] = update.error
                        if progress:
                            progress.update(1)
        if progress:
            progress.close()
        return [CompletionOutput(rid, tokens, outputs[rid], reasons[rid],
                                 self.tokenizer.decode(outputs[rid]) if is_text else None, errors[rid],
                                 scored[rid] if prompt_logprobs is not None else None)
                for rid, tokens, is_text in zip(ids, token_prompts, texts)]
