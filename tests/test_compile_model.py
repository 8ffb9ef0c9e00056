"""``compile_model``: the bundled model's forward through torch.compile gives the eager forward's tokens; the
engine's warm-up compiles the step shapes before any client and leaves nothing behind (no cached prefix, no
counted request); after it, a step shape no graph fits runs eagerly instead of compiling."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch._dynamo.utils

from cluster.engine.llm import LLM
from workers.runtime.worker import Worker

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compiled():
    return LLM("default", compile_model=True)


def _prompts(seed: int, n: int, lengths=(5, 300)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def test_a_compiled_forward_draws_the_eager_forwards_tokens_one_or_many_requests_at_a_time(compiled):
    eager = LLM("default")
    for prompts in (_prompts(1, 1), _prompts(2, 2), _prompts(3, 9)):
        want = [o.output_token_ids for o in eager.generate(prompts, max_tokens=40, ignore_eos=True)]
        got = [o.output_token_ids for o in compiled.generate(prompts, max_tokens=40, ignore_eos=True)]
        assert got == want and all(len(t) == 40 for t in got)


def test_the_warm_up_leaves_no_cached_prefix_and_no_counted_request():
    llm = LLM("default", compile_model=True)
    assert (llm.engine.metrics.steps, llm.engine.metrics.finished) == (0, {})
    warm_up_prompt = [1 + i for i in range(48)]                        # what the warm-up sent first
    llm.generate([warm_up_prompt], max_tokens=1)
    assert llm.engine.metrics.scheduled_tokens == 48                   # all of it computed: no hit


def test_after_the_warm_up_a_new_step_shape_runs_eagerly_instead_of_compiling(compiled):
    compiled.generate(_prompts(4, 3), max_tokens=4)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # Scoring the prompt asks for every row's logits: a shape class the warm-up never ran.
    out, = compiled.generate(_prompts(5, 1, (40, 41)), max_tokens=2, prompt_logprobs=1)
    assert len(out.prompt_logprobs) == 40 and len(out.output_token_ids) == 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


BROKEN_COMPILER = """
import json, sys
from cluster.engine.llm import LLM
prompts = [[5 + i % 200 for i in range(n)] for n in (7, 40, 90)]
runs = [LLM("default", compile_model=flag).generate(prompts, max_tokens=12, ignore_eos=True) for flag in (True, False)]
print(json.dumps([[o.output_token_ids for o in outs] for outs in runs]))
"""


def test_a_compiler_that_fails_leaves_the_forward_eager_and_the_tokens_the_same(tmp_path):
    # swakv serve compiles by default; a machine whose g++ is broken must still serve, eagerly.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "g++").write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'g++ 99' && exit 0\nexit 1\n")
    (bin_dir / "g++").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}    # nothing compiled before can be reused
    proc = subprocess.run([sys.executable, "-c", BROKEN_COMPILER], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled, eager = json.loads(proc.stdout.splitlines()[-1])
    assert compiled == eager and [len(t) for t in compiled] == [12, 12, 12]
    assert proc.stderr.count("compile_model: the forward failed to compile, it runs eagerly from now on") == 1


def test_a_worker_refuses_to_compile_with_cuda_graphs_or_tensor_parallel_ranks():
    for kwargs in ({"cuda_graphs": True}, {"tensor_parallel_size": 2}):
        with pytest.raises(ValueError, match="compile_model runs the whole model on one rank without CUDA graphs"):
            Worker("default", block_size=16, num_blocks=8, compile_model=True, **kwargs)
