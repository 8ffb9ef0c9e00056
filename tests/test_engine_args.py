"""EngineArgs: the one description of an engine, checked once, that the CLI, the Serve config, the load
test and LLM all build. A bad value is named before anything loads or starts."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from cluster.cli import build_parser, main
from cluster.engine.args import EngineArgs
from cluster.engine.build import build_engine
from cluster.loadtest.config import LoadTestConfig
from cluster.serve.builder import build


@pytest.mark.parametrize("changes, message", [
    ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
    ({"tensor_parallel_size": True}, "tensor_parallel_size must be an integer >= 1, got True"),
    ({"num_blocks": 1}, "num_blocks must be an integer >= 2, got 1"),
    ({"kv_cache_memory": "2GiB"}, "kv_cache_memory must be an integer >= 1, got '2GiB'"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be true or false, got 'yes'"),
    ({"num_gpus_per_worker": -1}, "num_gpus_per_worker must be a finite number >= 0, got -1"),
    ({"simulated_gpu": "B200"}, "unknown GPU 'B200'; known: H100-80GB, H200, A100-80GB, L40S"),
    ({"model": 42}, "model must be a model directory, a model name or a loaded model, got 42"),
    ({"compile_model": 1}, "compile_model must be true or false, got 1"),
    ({"compile_model": True, "tensor_parallel_size": 2}, "compile_model compiles one real worker holding the "
                                                         "whole model: it cannot go with simulated_gpu"),
    ({"compile_model": True, "simulated_gpu": "H200"}, "compile_model compiles one real worker"),
    ({"compile_model": True, "cuda_graphs": True}, "compile_model compiles one real worker"),
])
def test_a_bad_engine_argument_is_named(changes, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**changes)


def test_a_config_file_key_that_is_no_engine_argument_is_named():
    with pytest.raises(ValueError, match="unknown engine argument\\(s\\) 'blok_size'; known: async_scheduling, "):
        EngineArgs.from_dict({"model": "default", "blok_size": 16})
    assert EngineArgs.from_dict({"block_size": 32}) == EngineArgs(block_size=32)


def test_build_engine_takes_engine_args_or_the_model_and_their_fields():
    engine, info = build_engine(EngineArgs(model="tiny-llama", block_size=4, num_blocks=40))
    assert (engine.manager.num_blocks, info["block_size"], info["model"]) == (40, 4, "tiny-llama")
    engine, info = build_engine("tiny-llama", block_size=4, num_blocks=40)
    assert (engine.manager.num_blocks, info["block_size"]) == (40, 4)
    with pytest.raises(TypeError, match="blok_size"):
        build_engine("tiny-llama", blok_size=4)


def test_the_default_step_budget_is_the_knee_of_the_gpu_the_workers_sleep_for_and_one_token_per_running_sequence():
    # gemma-3-27b's weights set an H100's step time up to ~989.5 / 3.35 = 295 tokens (its knee: 304 with its
    # KV traffic, in 16s); on an A100 (312 / 2.039 = 153) the floor of one token per running sequence is higher.
    def budget(**kw):
        engine, info = build_engine(EngineArgs(**{"model": "gemma-3-27b", "simulated_gpu": "H100-80GB",
                                                  "sleep_factor": 1.0, **kw}))
        assert engine.scheduler.max_num_batched_tokens == info["max_num_batched_tokens"]
        return info["max_num_batched_tokens"]

    assert budget() == 304
    assert budget(simulated_gpu="A100-80GB") == 256
    assert budget(max_num_seqs=400) == 400
    assert budget(max_num_batched_tokens=100) == 100                # a budget given is kept, below the floor too
    assert budget(sleep_factor=0.0) == 512                          # workers that take no time: no knee
    assert build_engine(EngineArgs(model="tiny-llama", block_size=4, num_blocks=40))[1]["max_num_batched_tokens"] == 512


def test_a_simulated_model_of_unknown_size_is_refused_before_any_worker_starts(tmp_path):
    moe = {"model_type": "mistral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 64, "vocab_size": 1000,
           "torch_dtype": "bfloat16", "num_local_experts": 8}      # MoE, no weights beside it: no parameter count
    (tmp_path / "config.json").write_text(json.dumps(moe))
    with pytest.raises(ValueError, match="its active parameter count is unknown, so its steps cannot be costed"):
        build_engine(EngineArgs(model=str(tmp_path), simulated_gpu="H100-80GB", kv_cache_memory=1 << 26),
                     executor_cls=None)


def test_every_documented_field_is_a_serve_flag_with_its_default():
    parser = build_parser()
    args = parser.parse_args(["serve"])
    documented = [f for f in dataclasses.fields(EngineArgs) if f.metadata.get("help")]
    assert {f.name for f in documented} >= {"model", "tensor_parallel_size", "block_size", "kv_cache_memory",
                                             "enable_prefix_caching", "simulated_gpu"}
    assert args.compile_model is None                 # serve decides it (next tests); every other default is the field's
    assert EngineArgs(**{f.name: getattr(args, f.name) for f in documented if f.name != "compile_model"}) == EngineArgs()
    engine = serve_args("--block-size", "32", "--no-prefix-caching", "--kv-cache-memory", "2GiB",
                        "--num-gpus-per-worker", "0.5", "--simulated-gpu", "H200")
    assert (engine.block_size, engine.enable_prefix_caching, engine.kv_cache_memory, engine.num_gpus_per_worker,
            engine.simulated_gpu) == (32, False, 2 << 30, 0.5, "H200")


def test_overlapped_steps_are_the_default_and_a_flag_turns_them_off_or_on():
    parser = build_parser()
    assert EngineArgs().async_scheduling is True and parser.parse_args(["serve"]).async_scheduling is True
    assert parser.parse_args(["serve", "--no-async-scheduling"]).async_scheduling is False
    assert parser.parse_args(["serve", "--async-scheduling"]).async_scheduling is True   # older scripts' flag
    assert parser.parse_args(["serve", "--cuda-graphs"]).cuda_graphs is True
    assert parser.parse_args(["serve"]).cuda_graphs is False


def serve_args(*argv: str) -> EngineArgs:
    args = build_parser().parse_args(["serve", *argv])
    return EngineArgs.for_serve({f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
                                 if f.metadata.get("help")})


def test_serve_compiles_one_cpu_worker_by_default_and_a_flag_turns_it_off(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert EngineArgs().compile_model is False         # code (LLM, tests, benches) starts eagerly
    assert serve_args().compile_model is True
    assert serve_args("--device", "cpu", "-dp", "2").compile_model is True
    assert serve_args("--no-compile-model").compile_model is False
    assert serve_args("--compile-model").compile_model is True


def test_serve_runs_eagerly_by_default_where_compiling_cannot_or_should_not(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    for argv in (["--simulated-gpu", "H100-80GB"], ["--tensor-parallel-size", "2"],
                 ["--pipeline-parallel-size", "2"], ["--cuda-graphs"], ["--device", "cuda"], ["--device", "cuda:1"]):
        assert serve_args(*argv).compile_model is False, argv
    monkeypatch.setattr(shutil, "which", lambda name: None)      # no C++ compiler for inductor's CPU kernels
    assert serve_args().compile_model is False
    with pytest.raises(ValueError, match="compile_model compiles one real worker"):
        serve_args("--compile-model", "--simulated-gpu", "H100-80GB")   # asked for, it is refused, not ignored


def test_serve_refuses_a_bad_engine_argument_before_starting_anything(capsys):
    assert main(["serve", "--num-gpus-per-worker", "-1"]) == 2
    assert "swakv serve: error: num_gpus_per_worker must be a finite number >= 0, got -1.0" in capsys.readouterr().err


def test_the_serve_config_builder_refuses_a_bad_engine_argument_before_starting_anything():
    with pytest.raises(ValueError, match="unknown engine argument\\(s\\) 'blok_size'"):
        build({"model": "default", "blok_size": 16})
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1, got 0"):
        build({"model": "default", "max_num_seqs": 0})


def test_the_load_test_builds_one_engine_args_per_layout():
    cfg = LoadTestConfig(model="gemma-3-27b", gpu="H200", pipeline_parallel_size=2, kv_memory=1 << 30)
    window_aware, as_full = cfg.engine_args("window_aware"), cfg.engine_args("sliding_as_full")
    assert window_aware.replace(sliding_as_full=True) == as_full
    assert (window_aware.simulated_gpu, window_aware.pipeline_parallel_size, window_aware.kv_cache_memory,
            window_aware.spread_stages) == ("H200", 2, 1 << 30, True)
    real = LoadTestConfig(model="default", real=True, pipeline_parallel_size=1, kv_memory=None)
    assert real.engine_args("window_aware").simulated_gpu is None
