"""The official ``openai`` client against the real Serve app (real HTTP, the real engine actor) on the bundled
model, whose tokenizer has a chat template and an EOS token.

Expected tokens come from transformers' own dense forward of the same model, one token at a time, with
every option (bias, penalties, truncation) applied by the plain code below; logprobs are its log-softmax.
Sampled (non-greedy) outputs are checked where they are deterministic: a truncation that leaves one
token, a seed replayed, a sibling of ``n`` equal to the lone request with its seed.
"""
from __future__ import annotations

import functools
import json

import httpx

import openai
import pytest
import ray
import torch
import transformers
from ray import serve

from cluster.ray.engine_actor import NAMESPACE
from cluster.ray.ports import free_port
from cluster.engine.build import DEFAULT_MODEL
from cluster.serve.ray_serve import build_app, run

from drivers import start_engine_actor, stop_engine_actor

MODEL = "swakv-tiny-hybrid"
ENGINE = "test-openai-engine"
BLOCK, NUM_BLOCKS, MAX_LEN = 4, 1024, 384
EOS = 258
PROMPT = "The sliding window"
_handles = []


# -- the dense reference ---------------------------------------------------------------------------
@functools.cache
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL, local_files_only=True)


@functools.cache
def reference_model():
    return transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, local_files_only=True).eval()


@functools.cache
def next_logits(ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return reference_model()(torch.tensor([ids])).logits[0, -1].float()


def reference(prompt, max_tokens, *, bias=None, presence=0.0, frequency=0.0, repetition=1.0, stop_at_eos=True):
    """Greedy tokens with OpenAI's bias and penalties, and each step's raw log-softmax."""
    ids, out, logprobs = list(prompt), [], []
    for _ in range(max_tokens):
        logits = next_logits(tuple(ids))
        logprobs.append(torch.log_softmax(logits, -1))
        x = logits.clone()
        for t, b in (bias or {}).items():
            x[t] += b
        for t in set(ids):
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
        for t in set(out):
            x[t] -= frequency * out.count(t) + presence
        token = int(x.argmax())
        ids.append(token)
        out.append(token)
        if stop_at_eos and token == EOS:
            break
    return out, logprobs


@functools.cache
def prompt_log_softmax(ids: tuple[int, ...]) -> torch.Tensor:
    """[len(ids), vocab]: row q is the raw log-softmax after tokens 0..q, from one dense forward."""
    with torch.no_grad():
        return torch.log_softmax(reference_model()(torch.tensor([ids])).logits[0].float(), -1)


def token_text(t: int) -> str:
    return bytes([t]).decode("utf-8", "replace") if t < 256 else tokenizer().decode([t])


def encode(text: str) -> list[int]:
    return tokenizer().encode(text)


def text_of(ids) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


def chat_prompt(messages) -> list[int]:
    text = tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer().encode(text, add_special_tokens=False)


def engine_stats() -> dict:
    return ray.get(ray.get_actor(ENGINE, namespace=NAMESPACE).stats.remote(), timeout=30)


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(ray_runtime):
    try:
        handle, info = start_engine_actor(dict(model=DEFAULT_MODEL, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                                               max_model_len=MAX_LEN), name=ENGINE, max_restarts=0, timeout_s=120)
        _handles.append(handle)
        port = free_port()
        run(build_app(ENGINE, NAMESPACE, info["model"], DEFAULT_MODEL, MAX_LEN), port=port, name="test-openai")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        serve.shutdown()
        for handle in _handles:
            stop_engine_actor(handle)
        _handles.clear()


def completion_stream(client, **kwargs):
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    return chunks, "".join(c.choices[0].text for c in chunks if c.choices)


# -- completions ------------------------------------------------------------------------------------
def test_completion_greedy_streamed_and_not_with_usage_and_cached_tokens(client):
    prompt = encode(PROMPT)
    expected, _ = reference(prompt, 16)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16)
    assert r.object == "text_completion" and r.model == MODEL
    assert (r.choices[0].text, r.choices[0].token_ids) == (text_of(expected), expected)
    assert r.choices[0].finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(expected))
    # The same prompt again: every full block but the one holding the last prompt token is reused.
    chunks, text = completion_stream(client, prompt=PROMPT, max_tokens=16, stream_options={"include_usage": True})
    assert text == text_of(expected)
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert usage.completion_tokens == len(expected)


def test_batch_prompts_strings_and_token_lists_with_n(client):
    prompts = ["Alpha beta", "Gamma delta epsilon"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.token_ids == reference(encode(prompts[c.index // 2]), 6)[0]
    ids = [encode("one two"), encode("three")]
    chunks, _ = completion_stream(client, prompt=ids, max_tokens=5)
    for i in range(2):
        assert [t for c in chunks for t in c.choices[0].token_ids if c.choices[0].index == i] == \
               reference(ids[i], 5)[0]
    assert r.usage.prompt_tokens == sum(len(encode(p)) for p in prompts)   # a prompt counts once, not n times
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)


def test_echo_prepends_the_prompt(client):
    expected = text_of(reference(encode(PROMPT), 5)[0])
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, echo=True)
    assert r.choices[0].text == PROMPT + expected
    assert completion_stream(client, prompt=PROMPT, max_tokens=5, echo=True)[1] == PROMPT + expected
    ids = encode("Echo me")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True)
    assert r.choices[0].text == "Echo me" + text_of(reference(ids, 3)[0])


def test_completion_logprobs_are_the_models_raw_log_softmax(client):
    prompt = encode("Logprobs of")
    expected, steps = reference(prompt, 6)
    for stream in (False, True):
        if stream:
            chunks, _ = completion_stream(client, prompt=prompt, max_tokens=6, logprobs=3)
            parts = [c.choices[0].logprobs for c in chunks]
            lp = {k: [v for p in parts for v in getattr(p, k)] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                          "text_offset")}
        else:
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=3)
            lp = r.choices[0].logprobs.model_dump()
        assert lp["tokens"] == [bytes([t]).decode("utf-8", "replace") if t < 256 else "<|eos|>" for t in expected]
        assert lp["token_logprobs"] == pytest.approx([float(s[t]) for s, t in zip(steps, expected)], abs=1e-4)
        for top, step, t in zip(lp["top_logprobs"], steps, expected):
            values, ids = step.topk(3)
            want = {}
            for i, v in zip(ids.tolist(), values.tolist()):
                want.setdefault(bytes([i]).decode("utf-8", "replace") if i < 256 else tokenizer().decode([i]), v)
            assert top == pytest.approx(want, abs=1e-4)   # the greedy token is the top one: no extra entry
        assert lp["text_offset"] == [len(text_of(expected[:i])) for i in range(len(expected))]


def test_stop_strings_cut_the_text_and_streams_never_show_part_of_one(client):
    prompt = encode(PROMPT)
    full = text_of(reference(prompt, 40, stop_at_eos=False)[0])
    stop = full[12:16]                       # four bytes, four tokens: the stream must hold them back
    cut = full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stop=[stop, "\x00never"],
                                  extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    chunks, text = completion_stream(client, prompt=PROMPT, max_tokens=40, stop=stop, extra_body={"ignore_eos": True})
    assert text == cut and chunks[-1].choices[0].finish_reason == "stop"
    shown = ""
    for c in chunks:   # text past ``cut`` would be the start of the stop string
        shown += c.choices[0].text
        assert cut.startswith(shown)
    assert len(r.choices[0].token_ids) == len(encode(cut)) + len(stop)   # the engine stopped at the match


def test_deterministic_truncations_leave_the_greedy_token(client):
    """temperature 1 with top_k=1, a tiny top_p or min_p=1 leaves one token a step: the greedy one."""
    prompt = encode("Sampling that cannot vary")
    expected, _ = reference(prompt, 8)
    for extra in ({"top_p": 0.001}, {"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}}):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, **extra)
        assert r.choices[0].token_ids == expected, extra


def test_penalties_and_logit_bias_match_the_reference(client):
    prompt = encode("Repeat repeat repeat repeat")
    cases = [({"frequency_penalty": 1.5}, dict(frequency=1.5)),
             ({"presence_penalty": 2.0}, dict(presence=2.0)),
             ({"extra_body": {"repetition_penalty": 1.8}}, dict(repetition=1.8)),
             ({"logit_bias": {"32": -100, "101": 7.5}}, dict(bias={32: -100, 101: 7.5})),
             ({"presence_penalty": -1.0, "frequency_penalty": 0.5, "logit_bias": {"114": 3},
               "extra_body": {"repetition_penalty": 1.2}}, dict(presence=-1.0, frequency=0.5, bias={114: 3},
                                                              repetition=1.2))]
    plain, _ = reference(prompt, 12)
    for options, ref in cases:
        expected, _ = reference(prompt, 12, **ref)
        assert expected != plain, options            # the option matters for this prompt
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **options)
        assert r.choices[0].token_ids == expected, options
        chunks, _ = completion_stream(client, prompt=prompt, max_tokens=12, **options)
        assert [t for c in chunks for t in c.choices[0].token_ids] == expected, options


def test_seeds_replay_and_siblings_are_their_own_seeded_requests(client):
    prompt = "Once upon a"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=123, **kwargs).choices[0].text
    assert client.completions.create(seed=123, **kwargs).choices[0].text == a
    siblings = client.completions.create(seed=123, n=3, **kwargs)
    alone = [client.completions.create(seed=123 + j, **kwargs).choices[0].text for j in range(3)]
    assert [c.text for c in siblings.choices] == alone
    assert len(set(alone)) == 3
    unseeded = {client.completions.create(**kwargs).choices[0].text for _ in range(4)}
    assert len(unseeded) > 1   # no seed: each request draws its own randomness


def test_n_siblings_reuse_the_first_ones_prompt_blocks(client):
    prompt = encode("A prompt that nobody has sent before, long enough for several blocks.")
    before = engine_stats()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=4)
    after = engine_stats()
    reusable = (len(prompt) - 1) // BLOCK * BLOCK
    assert r.usage.prompt_tokens_details.cached_tokens == 0          # the prompt itself was new
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 3 * reusable
    assert after["prefix_queried_tokens"] - before["prefix_queried_tokens"] == 4 * len(prompt)
    assert [c.token_ids for c in r.choices] == [reference(prompt, 4)[0]] * 4
    chunks, _ = completion_stream(client, prompt=prompt, max_tokens=4, n=2)
    assert sorted({c.choices[0].index for c in chunks}) == [0, 1]


# -- chat -------------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def test_chat_uses_the_models_template_and_runs_to_eos_or_the_context_end(client):
    prompt = chat_prompt(MESSAGES)
    assert prompt[0] == 257   # the template's BOS: the model's own template was applied
    expected, _ = reference(prompt, MAX_LEN - len(prompt))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES)   # no max_tokens: the rest of the context
    assert r.choices[0].message.content == text_of(expected)
    assert r.choices[0].token_ids == expected
    assert r.choices[0].finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert len(expected) > 16
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text_of(expected[:10])


def test_chat_logprobs_and_top_logprobs(client):
    prompt = chat_prompt(MESSAGES)
    expected, steps = reference(prompt, 5)
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True,
                                                         top_logprobs=2, stream=True))
            content = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        else:
            r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True,
                                               top_logprobs=2)
            content = r.choices[0].logprobs.content
        assert [e.bytes for e in content] == [list(bytes([t])) if t < 256 else list(b"<|eos|>") for t in expected]
        assert [e.logprob for e in content] == pytest.approx([float(s[t]) for s, t in zip(steps, expected)], abs=1e-4)
        for e, step in zip(content, steps):
            values, ids = step.topk(2)
            assert [t.bytes for t in e.top_logprobs] == [list(bytes([i])) for i in ids.tolist()]
            assert [t.logprob for t in e.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert r.choices[0].logprobs is None


def test_chat_n_and_stop(client):
    prompt = chat_prompt(MESSAGES)
    full = text_of(reference(prompt, 30, stop_at_eos=False)[0])
    stop = full[5:8]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, n=2, stop=stop,
                                       extra_body={"ignore_eos": True})
    assert [(c.index, c.message.content, c.finish_reason) for c in r.choices] == \
           [(0, full[:full.index(stop)], "stop"), (1, full[:full.index(stop)], "stop")]


# -- models and refusals ----------------------------------------------------------------------------
def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert (err.value.code, err.value.param, err.value.type) == ("model_not_found", "model", "invalid_request_error")
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert err.value.code == "model_not_found"


REFUSED = [
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"suffix": "after"}, "suffix"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ("completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"n": 17}, "n"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"extra_body": {"guided_json": {}}}, "guided_json"),
    ("completions", {"top_p": 0.0}, "top_p"),
    ("completions", {"seed": 2**64}, "seed"),
    ("completions", {"extra_body": {"top_k": -2}}, "top_k"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"modalities": ["audio"]}, "modalities"),
    ("chat", {"extra_body": {"min_tokens": 5}}, "min_tokens"),
]


@pytest.mark.parametrize("endpoint,options,param", REFUSED, ids=[f"{e}-{p}" for e, _, p in REFUSED])
def test_options_that_would_change_the_output_are_refused_naming_the_field(client, endpoint, options, param):
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **options)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **options)
    assert err.value.param.split(".")[0] == param and param in err.value.message   # e.g. modalities.0
    assert set(err.value.body) == {"message", "type", "param", "code"} and err.value.code is None


def test_harmless_fields_are_accepted(client):
    expected = reference(encode("x"), 2)[0]
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, user="u-1", best_of=1,
                                  extra_body={"metadata": {"team": "a"}, "store": False})
    assert r.choices[0].token_ids == expected
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, user="u-1",
                                       response_format={"type": "text"}, tool_choice="none", parallel_tool_calls=True)
    assert r.choices[0].token_ids == reference(chat_prompt(MESSAGES), 2)[0]


# -- what OpenAI's, vLLM's and eval harnesses' clients send --------------------------------------------
def test_null_means_as_if_omitted_for_every_nullable_field(client):
    expected = reference(encode(PROMPT), 4)[0]
    nulls = dict(temperature=None, top_p=None, n=None, presence_penalty=None, frequency_penalty=None, stream=None,
                 echo=None, logprobs=None, seed=None, stop=None, user=None, best_of=None, logit_bias=None,
                 suffix=None, stream_options=None)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **nulls,
                                  extra_body={"top_k": None, "min_p": None, "repetition_penalty": None,
                                              "ignore_eos": None, "stop_token_ids": None, "prompt_logprobs": None})
    assert (r.choices[0].token_ids, r.choices[0].logprobs) == (expected, None)
    chat = dict(temperature=None, top_p=None, n=None, presence_penalty=None, frequency_penalty=None, stream=None,
                logprobs=None, top_logprobs=None, seed=None, stop=None, max_completion_tokens=None, tools=None,
                tool_choice=None, response_format=None, stream_options=None, parallel_tool_calls=None)
    r = client.chat.completions.create(model=MODEL, messages=[{**MESSAGES[1], "name": None}], max_tokens=3, **chat)
    assert r.choices[0].token_ids == reference(chat_prompt(MESSAGES[1:]), 3)[0]
    chunks, text = completion_stream(client, prompt=PROMPT, max_tokens=4,
                                     stream_options={"include_usage": None, "continuous_usage_stats": None})
    assert text == text_of(expected) and all(c.usage is None for c in chunks)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_with_max_tokens_0_or_more(client):
    text = "Score this prompt, as lm-eval does"
    prompt = encode(text)
    ref = prompt_log_softmax(tuple(prompt))
    want_prompt = [None] + [float(ref[q - 1, prompt[q]]) for q in range(1, len(prompt))]
    for max_tokens in (0, 1, 3):
        generated, steps = reference(prompt, max_tokens)
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, echo=True, logprobs=2,
                                      temperature=0)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == text + text_of(generated)
        assert lp.tokens == [token_text(t) for t in prompt + generated]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(
            want_prompt[1:] + [float(s[t]) for s, t in zip(steps, generated)], abs=1e-4)
        assert lp.text_offset == list(range(len(prompt))) + [len(text) + len(text_of(generated[:i]))
                                                               for i in range(len(generated))]
        for q in range(1, len(prompt)):   # the top 2, and the prompt's own token when it is not among them
            values, ids = ref[q - 1].topk(2)
            want = dict(zip(map(token_text, ids.tolist()), values.tolist()))
            want.setdefault(token_text(prompt[q]), float(ref[q - 1, prompt[q]]))
            assert lp.top_logprobs[q] == pytest.approx(want, abs=1e-4)
        assert r.choices[0].finish_reason == ("stop" if generated and generated[-1] == EOS else "length")
        assert r.usage.completion_tokens == len(generated)
        chunks, streamed = completion_stream(client, prompt=text, max_tokens=max_tokens, echo=True, logprobs=2)
        assert streamed == r.choices[0].text
        assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    # token ids as the prompt, as lm-eval's local-completions sends them (max_tokens 1, logprobs 1)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert r.choices[0].logprobs.token_logprobs[:len(prompt)] == pytest.approx(want_prompt, abs=1e-4)


def test_vllm_prompt_logprobs_give_each_token_its_logprob_and_rank(client):
    prompt = encode("Ranks of a prompt")
    ref = prompt_log_softmax(tuple(prompt))

    def expected(k):
        out = [None]
        for q in range(1, len(prompt)):
            row, t = ref[q - 1], prompt[q]
            entry = {str(t): (float(row[t]), 1 + int((row > row[t]).sum()), token_text(t))}
            values, ids = row.topk(k)
            for r, (i, v) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
                entry.setdefault(str(i), (v, r, token_text(i)))
            out.append(entry)
        return out

    def as_tuples(scored):
        return [None if e is None else {t: (v["logprob"], v["rank"], v["decoded_token"]) for t, v in e.items()}
                for e in scored]

    for k in (0, 3):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": k})
        got = as_tuples(r.choices[0].model_extra["prompt_logprobs"])
        want = expected(k)
        assert [None if e is None else {t: (v[1], v[2]) for t, v in e.items()} for e in got] == \
               [None if e is None else {t: (v[1], v[2]) for t, v in e.items()} for e in want]
        assert [None if e is None else {t: v[0] for t, v in e.items()} for e in got] == \
               [None if e is None else pytest.approx({t: v[0] for t, v in e.items()}, abs=1e-4) for e in want]
        assert r.choices[0].token_ids == reference(prompt, 2)[0] and r.choices[0].logprobs is None
    chat = chat_prompt(MESSAGES)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": 1})
    scored = r.model_extra["prompt_logprobs"]   # vLLM's chat: on the response, not a choice
    ref = prompt_log_softmax(tuple(chat))
    assert len(scored) == len(chat) and scored[0] is None
    assert [e[str(t)]["logprob"] for e, t in zip(scored[1:], chat[1:])] == \
           pytest.approx([float(ref[q - 1, chat[q]]) for q in range(1, len(chat))], abs=1e-4)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    prompt = encode(PROMPT)
    expected, _ = reference(prompt, 6, stop_at_eos=False)
    chunks, text = completion_stream(client, prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True},
                                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert text == text_of(expected)
    counted = [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) for c in chunks]
    produced = 0
    for c, (p, done, total) in zip(chunks[:-1], counted):
        produced += len(c.choices[0].token_ids)
        assert (p, done, total) == (len(prompt), produced, len(prompt) + produced)
    assert counted[-1] == (len(prompt), 6, len(prompt) + 6) and chunks[-1].choices == []
    chat = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
                                               extra_body={"ignore_eos": True},
                                               stream_options={"include_usage": False, "continuous_usage_stats": True}))
    # the role chunk first (nothing yet), then the tokens so far: one event each, or several in one event
    # when the stream fell behind (cluster/serve/feed.py merges what a stream is owed; a loaded CI host did)
    so_far = [c.usage.completion_tokens for c in chat]
    assert so_far[0] == 0 and so_far[-1] == 3 and all(a < b for a, b in zip(so_far, so_far[1:]))
    assert {c.usage.prompt_tokens for c in chat} == {len(chat_prompt(MESSAGES))}


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(client):
    prompt = encode(PROMPT)
    full, _ = reference(prompt, 30, stop_at_eos=False)
    text = text_of(full)
    stop = text[10:13]
    token = full[7]
    first = full.index(token)
    cases = [(dict(stop=[stop]), "stop", stop, len(encode(text[:text.index(stop)])) + len(stop)),
             (dict(extra_body={"stop_token_ids": [token], "ignore_eos": True}), "stop", token, first + 1),
             (dict(extra_body={"ignore_eos": True}), "length", None, 30)]
    for options, finish, reason, produced in cases:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, **options)
        c = r.choices[0]
        assert (c.finish_reason, c.model_extra["stop_reason"], len(c.token_ids)) == (finish, reason, produced)
        chunks, _ = completion_stream(client, prompt=PROMPT, max_tokens=30, **options)
        assert [ch.choices[0].model_extra["stop_reason"] for ch in chunks] == [None] * (len(chunks) - 1) + [reason]


def test_tokenize_and_detokenize_in_vllms_shapes(client):
    base = str(client.base_url).removesuffix("/v1/")
    ids = encode(PROMPT)

    def post(path, body):
        return httpx.post(base + path, json=body, timeout=30)

    assert post("/tokenize", {"model": MODEL, "prompt": PROMPT}).json() == {
        "count": len(ids), "max_model_len": MAX_LEN, "tokens": ids, "token_strs": None}
    r = post("/tokenize", {"prompt": "Ab c", "return_token_strs": True, "add_special_tokens": False}).json()
    assert (r["tokens"], r["token_strs"]) == ([65, 98, 32, 99], ["A", "b", "Ġ", "c"])
    chat = chat_prompt(MESSAGES)
    assert post("/tokenize", {"messages": MESSAGES}).json()["tokens"] == chat
    bare = tokenizer().apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"] == \
        tokenizer().encode(bare, add_special_tokens=False) != chat
    assert post("/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": PROMPT}
    assert post("/detokenize", {"tokens": chat}).json() == {"prompt": text_of(chat)}
    for path, body, param in [("/detokenize", {"tokens": [1, 259]}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, "model"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{"},
                               "chat_template")]:
        r = post(path, body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_prompt_and_max_tokens_beyond_the_context_are_refused_with_the_figures(client):
    prompt = encode(PROMPT)   # 18 tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100000)
    assert (err.value.param, err.value.code) == ("max_tokens", "context_length_exceeded")
    assert err.value.body["message"] == (
        f"max_tokens: this model's maximum context length is {MAX_LEN} tokens (max_model_len); you requested "
        f"{len(prompt) + 100000} tokens ({len(prompt)} in prompt, 100000 in max_tokens). max_tokens can be at most "
        f"{MAX_LEN - len(prompt)} for this prompt, or omitted (the rest of the context)")
    chat = chat_prompt(MESSAGES)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=MAX_LEN)
    assert err.value.param == "max_completion_tokens"
    assert f"max_completion_tokens can be at most {MAX_LEN - len(chat)} for this prompt" in err.value.body["message"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_LEN - len(prompt),
                                  extra_body={"ignore_eos": True})   # exactly the context: served to the end
    assert len(r.choices[0].token_ids) == MAX_LEN - len(prompt)
    full = [65] * MAX_LEN   # a whole-context prompt may be scored (max_tokens 0), not continued
    r = client.completions.create(model=MODEL, prompt=full, max_tokens=0, echo=True, logprobs=0)
    assert len(r.choices[0].logprobs.token_logprobs) == MAX_LEN and r.choices[0].token_ids == []
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=full, max_tokens=1)
    assert (err.value.param, err.value.code) == ("prompt", "context_length_exceeded")
