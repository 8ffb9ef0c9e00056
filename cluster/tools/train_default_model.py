"""Train swakv's default model: a tiny hybrid (sliding + full attention) byte-level Gemma-3 causal LM.

``python -m cluster.tools.train_default_model --out models/swakv-tiny-hybrid``

The point is a model that ships with the repository and runs offline on a laptop CPU, so ``make serve``
answers with text rather than noise, while exercising both KV-cache groups (sliding and full). It is
trained for a few minutes on two CPU cores on text every CPython 3.11 install carries: the docstrings of
the standard library and the reference-manual topics in ``pydoc_data``. Nothing is downloaded.
Everything is deterministic given the Python version: sorted files, fixed seeds.

Tokens are bytes (id = byte value), plus three special tokens, so the tokenizer needs no training and
round-trips any UTF-8 text. Some docstrings are rendered as chat exchanges through the shipped chat
template, so chat requests get an answer in the trained format that ends with the end-of-text token.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

# Two OpenMP threads spin-waiting on cores shared with other processes slow training tenfold; passive
# waiting keeps it near the unshared speed. Must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from tqdm import tqdm  # noqa: E402

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258          # after the 256 byte ids
VOCAB_SIZE = 259
SLIDING_WINDOW = 64
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2   # 2:1, so PP=2 keeps both kinds
MAX_POSITIONS = 2048

# Roles are plain text; the assistant's turn ends with the end-of-text token, as in training.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
                 "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "turtledemo"}
_MIN_DOC_CHARS = 40
_CHAT_EVERY = 3          # every third public docstring becomes a chat exchange
_VAL_EVERY = 25          # every 25th document is held out for validation


def model_config() -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=512, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=SLIDING_WINDOW, sliding_window_pattern=3, layer_types=LAYER_TYPES,
        max_position_embeddings=MAX_POSITIONS, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        tie_word_embeddings=True, dtype="float32")


def _byte_chars() -> dict[int, str]:
    """The byte -> character table of byte-level pre-tokenisation: printable Latin-1 bytes stand for
    themselves, the others are moved to code points from 256 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """Byte ``b`` is token ``b``; no merges, so encoding is just the UTF-8 bytes."""
    vocab = {char: b for b, char in _byte_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, BOS, EOS)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    if [fast.pad_token_id, fast.bos_token_id, fast.eos_token_id] != [PAD_ID, BOS_ID, EOS_ID]:
        raise RuntimeError("special token ids differ from the model config's")
    return fast


def _docstrings(path: Path, module: str) -> list[tuple[str, str]]:
    """(qualified name, cleaned docstring) for the module and every class and function in it."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    found = []

    def visit(node: ast.AST, name: str) -> None:
        doc = ast.get_docstring(node)
        if doc and len(doc) >= _MIN_DOC_CHARS:
            found.append((name, doc))
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{name}.{child.name}")

    visit(tree, module)
    return found


def build_corpus(tokenizer) -> list[str]:
    """Documents in a fixed order: reference topics, plain docstrings, and docstrings as chat exchanges."""
    from pydoc_data.topics import topics
    docs = [topics[key].strip() for key in sorted(topics)]
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    named = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS & set(rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for name, doc in _docstrings(path, module):
            if doc in seen:
                continue
            seen.add(doc)
            public = not any(part.startswith("_") for part in name.split("."))
            if name != module and public and named % _CHAT_EVERY == 0:
                answer = doc.split("\n\n")[0]
                messages = [{"role": "user", "content": f"What does {name} do?"},
                            {"role": "assistant", "content": answer}]
                docs.append(tokenizer.apply_chat_template(messages, tokenize=False))
            else:
                docs.append(doc)
            named += name != module and public
    return docs


def encode_corpus(tokenizer, docs: list[str]) -> list[list[int]]:
    """Token ids per document; plain documents are wrapped in bos/eos, chat ones carry them already."""
    encoded = tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False)
    return [e.ids if doc.startswith(BOS) else [BOS_ID, *e.ids, EOS_ID] for doc, e in zip(docs, encoded)]


def split_streams(encoded: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the documents into a training stream and a held-out validation stream."""
    train = [i for n, doc in enumerate(encoded) if n % _VAL_EVERY for i in doc]
    val = [i for n, doc in enumerate(encoded) if not n % _VAL_EVERY for i in doc]
    return torch.tensor(train, dtype=torch.int16), torch.tensor(val, dtype=torch.int16)


def _windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()]).long()


def _loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, val: torch.Tensor, batch_size: int, seq_len: int, num_batches: int) -> float:
    """Mean loss (nats per token) over evenly spaced, fixed windows of the validation stream."""
    model.eval()
    starts = torch.linspace(0, len(val) - seq_len - 2, num_batches * batch_size).long()
    losses = [_loss(model, _windows(val, chunk, seq_len)).item() for chunk in starts.split(batch_size)]
    model.train()
    return sum(losses) / len(losses)


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def train(train_stream: torch.Tensor, val_stream: torch.Tensor, args: argparse.Namespace):
    """Returns the model at its best validation loss, and a record of the run."""
    torch.manual_seed(args.seed)
    config = model_config()
    config._attn_implementation = "sdpa"
    model = transformers.Gemma3ForCausalLM(config).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, args.steps, args.warmup))
    sampler = torch.Generator().manual_seed(args.seed)
    best = {"val_loss": float("inf"), "step": 0, "state": None}
    started = time.monotonic()
    bar = tqdm(range(1, args.steps + 1), desc="training", unit="step", mininterval=2.0)
    for step in bar:
        starts = torch.randint(0, len(train_stream) - args.seq_len - 1, (args.batch_size,), generator=sampler)
        loss = _loss(model, _windows(train_stream, starts, args.seq_len))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", best_val=f"{best['val_loss']:.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            val_loss = evaluate(model, val_stream, args.batch_size, args.seq_len, args.eval_batches)
            tqdm.write(f"step {step}: train {loss.item():.3f}  val {val_loss:.3f} nats/byte")
            if val_loss < best["val_loss"]:
                best = {"val_loss": val_loss, "step": step,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    model.load_state_dict(best["state"])
    record = {"best_step": best["step"], "best_val_loss": round(best["val_loss"], 4),
              "train_seconds": round(time.monotonic() - started)}
    return model.eval(), record


def save_tokenizer(tokenizer, out: Path) -> None:
    """Chat template inside tokenizer_config.json and the generic class name, which transformers 4.x loads too."""
    tokenizer.save_pretrained(out, save_jinja_files=False)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def write_model_card(out: Path, args: argparse.Namespace, corpus: dict, record: dict, samples: dict) -> None:
    c = model_config()
    kinds = c.layer_types
    params = sum(p.numel() for p in transformers.Gemma3ForCausalLM(c).parameters()) / 1e6
    order = ", ".join("S" if k == "sliding_attention" else "F" for k in kinds)
    lines = [
        "# swakv-tiny-hybrid", "",
        "swakv's default model: a **tiny** byte-level causal LM, so that `make serve` answers offline on a CPU",
        f"with text rather than noise. It is **not a useful assistant**: {params:.2f} M parameters and a few",
        "minutes of CPU training. It continues prompts with English-like fragments of Python documentation,",
        "often repetitive and never reliable.", "",
        f"- Architecture: `Gemma3ForCausalLM` (transformers), {len(kinds)} layers in the order `{order}`:",
        f"  {kinds.count('sliding_attention')} sliding-window (window {c.sliding_window}) and "
        f"{kinds.count('full_attention')} full attention; hidden {c.hidden_size},",
        f"  {c.num_attention_heads} query and {c.num_key_value_heads} KV heads of {c.head_dim}, MLP "
        f"{c.intermediate_size}, tied embeddings, float32, max positions {c.max_position_embeddings}.",
        f"- Tokenizer: one token per UTF-8 byte (token id = byte value), plus `{PAD}` = {PAD_ID},",
        f"  `{BOS}` = {BOS_ID}, `{EOS}` = {EOS_ID}. Chat template: `<|user|>` / `<|assistant|>` role lines in",
        f"  plain text after `{BOS}`; an assistant turn ends with `{EOS}`.",
        f"- Training text: {corpus['documents']} documents, {corpus['bytes'] / 1e6:.2f} MB, all from CPython "
        f"{corpus['python']}'s own",
        "  installation: the docstrings of the standard library (test packages excluded; every third public",
        "  docstring rendered as a chat exchange \"What does NAME do?\") and the reference-manual topics of",
        f"  `pydoc_data`. Every {_VAL_EVERY}th document is held out. Corpus sha256",
        f"  `{corpus['sha256']}`.",
        f"- Training: {args.steps} steps of {args.batch_size} x {args.seq_len} bytes, AdamW, peak learning rate "
        f"{args.lr}, seed {args.seed},",
        f"  {args.threads} CPU threads, {record['train_seconds']} s wall time. Held-out loss "
        f"**{record['best_val_loss']} nats/byte** at step {record['best_step']}",
        "  (this checkpoint: the best of those evaluated).",
        "- Greedy samples (`transformers` generate):", "",
        *(f"    {json.dumps(p)} -> {json.dumps(s)}" for p, s in samples.items()), "",
        "Rebuild it with `python -m cluster.tools.train_default_model --out models/swakv-tiny-hybrid`.",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "warmup", "eval_every", "eval_batches", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.lr > 0:
        parser.error("--lr must be > 0")
    torch.set_num_threads(args.threads)

    tokenizer = build_tokenizer()
    docs = build_corpus(tokenizer)
    text = "".join(docs).encode()
    corpus = {"documents": len(docs), "bytes": len(text), "sha256": hashlib.sha256(text).hexdigest(),
              "python": ".".join(map(str, sys.version_info[:3]))}
    train_stream, val_stream = split_streams(encode_corpus(tokenizer, docs))
    print(f"corpus: {corpus['documents']} documents, {corpus['bytes']:,} bytes; "
          f"train {len(train_stream):,} / val {len(val_stream):,} tokens")

    model, record = train(train_stream, val_stream, args)
    samples = {p: greedy(model, tokenizer, p, 48) for p in ("The ", "Return the ")}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What does os.path.join do?"}],
                                         tokenize=False, add_generation_prompt=True)
    samples[chat] = greedy(model, tokenizer, chat, 64)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    save_tokenizer(tokenizer, args.out)
    write_model_card(args.out, args, corpus, record, samples)
    for prompt, text in samples.items():
        print(f"{prompt!r} -> {text!r}")
    print(f"best held-out loss {record['best_val_loss']} nats/byte at step {record['best_step']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
