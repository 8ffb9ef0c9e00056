"""A short walk through the manager on a hybrid layout: what the sliding group drops, what a hit reuses."""
from __future__ import annotations

from kvmanager import NULL_BLOCK_ID, FullAttention, KVCacheManager, Request, SlidingWindow


def _describe(ids: list[int]) -> str:
    nulls = sum(1 for i in ids if i == NULL_BLOCK_ID)
    return f"{len(ids):>4} entries, {nulls:>4} null, {len(ids) - nulls:>4} real"


def run(prompt_len: int = 4000, chunk: int = 1000, window: int = 512, block_size: int = 16,
        decode_steps: int = 200) -> None:
    groups = [FullAttention(block_size), SlidingWindow(block_size, window=window)]
    mgr = KVCacheManager(groups, num_blocks=2048, enable_prefix_caching=True)
    print(f"hybrid layout: full + sliding(W={window}), block {block_size}, pool {mgr.num_blocks} blocks")
    req = Request("chat-turn-1", [i % 251 for i in range(prompt_len)])
    while req.num_computed_tokens < prompt_len:
        n = min(chunk, prompt_len - req.num_computed_tokens)
        mgr.allocate_slots(req, n)
        req.num_computed_tokens += n
        full, sliding = mgr.get_block_ids(req.request_id)
        print(f"prefill to {req.num_computed_tokens:>5}: full {_describe(full)} | sliding {_describe(sliding)}")
    for step in range(decode_steps):
        req.append_output_token_ids([(prompt_len + step) % 251])
        mgr.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    full, sliding = mgr.get_block_ids(req.request_id)
    bound = -(-(window - 1) // block_size) + 1
    print(f"after {decode_steps} decodes: full {_describe(full)} | sliding {_describe(sliding)} "
          f"(bound {bound} real)")
    print(f"pool: {mgr.num_free_blocks} free, usage {mgr.usage:.1%}")
    history = req.all_token_ids
    mgr.free(req)
    follow_up = Request("chat-turn-2", history + [7, 8, 9])
    hit, num_hit = mgr.get_computed_blocks(follow_up)
    print(f"follow-up turn of {follow_up.num_tokens} tokens: prefix hit {num_hit} tokens; "
          f"sliding group reuses {sum(1 for b in hit[1] if b.block_id)} cached blocks")
