"""Decode steps padded to CUDA-graph buckets give the logits of the unpadded batch.

Without a GPU nothing is captured: the padded batch runs eagerly through exactly the code a graph captures
(inputs read from the packed buffer at the bucket's offsets, the members gather, the slot mapping, the
forward of every row), so the bucketing and the padding rows are what these tests check. The capture
itself runs in bench/gpu_run.sh on the device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cluster.engine.llm import LLM
from workers.runtime.cuda_graphs import BATCH_SIZES, DecodeGraphs, bucket_batch, bucket_width
from workers.models.tiny_models import build_tiny_model
from workers.runtime.worker import Worker

try:
    from test_async_scheduling import PROMPTS, reference
    from test_worker import HandTables, dense_logits, run_schedule, tokens
except ImportError:  # tests/ became a package
    from tests.test_async_scheduling import PROMPTS, reference
    from tests.test_worker import HandTables, dense_logits, run_schedule, tokens


def test_buckets_round_up_to_the_next_size_and_power_of_two_width():
    assert [bucket_batch(n) for n in (1, 2, 3, 5, 17, 25, 33, 97, 200, 256, 257)] == \
        [1, 2, 4, 8, 24, 32, 48, 128, 256, 256, None]
    assert [bucket_width(w) for w in (1, 16, 17, 72, 1025)] == [16, 16, 32, 128, 2048]
    graphs = DecodeGraphs(None, None, lambda: 0, capture=False)
    assert graphs.key(3, 3, 5) == (4, 16)        # three decode rows, tables of 5 blocks
    assert graphs.key(3, 7, 5) is None           # a prefill chunk among them: eager
    assert graphs.key(300, 300, 5) is None       # more rows than the largest bucket
    assert graphs.key(0, 0, 0) is None
    with pytest.raises(ValueError, match="increasing"):
        DecodeGraphs(None, None, lambda: 0, sizes=(4, 2))
    assert BATCH_SIZES[-1] == 256


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gemma2", "tiny-llama4"])
def test_padded_decode_steps_give_the_logits_of_the_unpadded_batch(name):
    plain = Worker(build_tiny_model(name), block_size=4, num_blocks=96)
    padded = Worker(build_tiny_model(name), block_size=4, num_blocks=96, cuda_graphs=True)
    ref = build_tiny_model(name)
    seqs = {"A": tokens(1, 42), "B": tokens(2, 23), "C": tokens(3, 19)}
    expected = {rid: dense_logits(ref, s) for rid, s in seqs.items()}
    rows = list(run_schedule(padded.forward, padded, seqs))
    plain_rows = list(run_schedule(plain.forward, plain, seqs))
    for (rid, end, row), (_, _, plain_row) in zip(rows, plain_rows, strict=True):
        torch.testing.assert_close(row, plain_row, atol=1e-5, rtol=0)
        torch.testing.assert_close(row, expected[rid][end - 1], atol=1e-4, rtol=0)
    # the schedule's decode-only steps (2 rows -> bucket 2, 1 row -> 1) took the padded path, nothing else
    assert padded.graphs.runs == 3 and plain.graphs is None


def test_padding_rows_write_only_into_the_null_block():
    worker = Worker(build_tiny_model("tiny-mistral"), block_size=4, num_blocks=32, cuda_graphs=True)
    hand = HandTables(worker, num_blocks=32)
    worker.forward(hand.step(0, [hand.chunk(r, tokens(i, 9), 0) for i, r in enumerate("ABC")]))
    caches = [k.clone() for k, _ in worker.kv.caches.values()]
    step = hand.step(1, [hand.chunk(r, [5], 9) for r in "ABC"])       # 3 rows -> bucket 4: one padding row
    slots = {b * 4 + 1 for b in (hand.tables[r][0][2] for r in "ABC")}   # position 9: block 2, offset 1
    worker.forward(step)
    assert worker.graphs.runs == 1
    for before, (after, _) in zip(caches, worker.kv.caches.values()):
        changed = {int(s) for s in (before != after).flatten(2).any(-1).flatten().nonzero()}
        assert changed - slots <= set(range(4)), "a padding row wrote outside the null block"
        assert slots <= changed and 0 in changed         # the padding row's K went to the null block


def test_engine_with_padded_decode_and_overlap_gives_transformers_tokens():
    llm = LLM("tiny-gemma3", block_size=4, num_blocks=40, max_num_batched_tokens=16, cuda_graphs=True,
              async_scheduling=True)
    outs = llm.generate(PROMPTS, max_tokens=12)
    assert [o.output_token_ids for o in outs] == [reference("tiny-gemma3", tuple(p), 12) for p in PROMPTS]
    assert llm.engine.executor.workers[0].graphs.runs > 10
    assert llm.engine.stats()["preemptions"] >= 1


TRITON_SCRIPT = """
import json, sys
from cluster.engine.llm import LLM
prompts = json.loads(sys.argv[1])
llm = LLM("tiny-gemma3", block_size=4, num_blocks=64, max_num_batched_tokens=8, cuda_graphs=True,
          async_scheduling=True)
outs = llm.generate(prompts, max_tokens=6)
print(json.dumps({"tokens": [o.output_token_ids for o in outs], "runs": llm.engine.executor.workers[0].graphs.runs}))
"""


def test_padded_decode_through_the_triton_kernel_under_the_interpreter():
    from conftest import ROOT
    prompts = [PROMPTS[0][:12], PROMPTS[1][:10], PROMPTS[2][:9]]
    env = {**os.environ, "SWAKV_ATTENTION_BACKEND": "triton", "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, json.dumps(prompts)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tokens"] == [reference("tiny-gemma3", tuple(p), 6) for p in prompts]
    assert result["runs"] >= 4
