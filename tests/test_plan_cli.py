"""``swakv plan``: hand-computed plans, the derived budget, the CLI and its errors."""
import argparse
import json

import pytest

from cluster.tools.args import parse_bytes
from cluster.tools.planner import plan, register

GiB = 1 << 30


def run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="swakv")
    register(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_gemma3_27b_at_32k_by_hand():
    p = plan("gemma-3-27b", context=32768, kv_memory=20 * GiB)
    wa, sf = p["window_aware"], p["sliding_as_full"]
    # Page of one layer: 2 (K, V) x 16 tokens x 16 KV heads x 128 x 2 bytes = 131072 B.
    # Window-aware: 52 sliding + 10 full -> gcd 2 layers per unit, 262144 B per unit; one group per kind,
    # a sliding block spans 26 units and a full one 5.
    assert (wa["num_groups"], wa["group_widths"], wa["block_bytes"]) == (2, [26, 5], 262144)
    # Per request: sliding ceil(1023 / 16) + 1 = 65 blocks x 26 units + full 32768 / 16 = 2048 blocks x 5 units.
    assert wa["blocks_per_request"] == 26 * 65 + 5 * 2048 == 11930
    assert wa["kv_bytes_per_request"] == 11930 * 262144 == 3_127_377_920
    # 20 GiB / 262144 = 81920 units, one of them null: 81919 // 11930 = 6.
    assert (wa["num_blocks"], wa["max_concurrency"]) == (81920, 6)
    # Prefill peak, 512-token chunks: sliding ceil((1023 + 512 - 1) / 16) + 1 = 97 -> 26 x 97 + 10240.
    assert wa["prefill_peak_kv_bytes_per_request"] == (26 * 97 + 10240) * 262144
    assert wa["max_concurrency_prefill_peak"] == 81919 // 12762 == 6
    # Sliding-as-full: 62 full layers in one group of width 1, 62 x 131072 = 8126464 B per unit, 2048 each.
    assert (sf["num_groups"], sf["group_widths"], sf["block_bytes"], sf["blocks_per_request"]) == \
        (1, [1], 8126464, 2048)
    assert sf["kv_bytes_per_request"] == 2048 * 8126464 == 16_642_998_272
    assert (sf["num_blocks"], sf["max_concurrency"]) == (20 * GiB // 8126464, 1) == (2642, 1)
    assert p["concurrency_ratio"] == 6.0
    assert p["kv_bytes_ratio"] == pytest.approx(16_642_998_272 / 3_127_377_920)


def test_mistral_7b_at_32k_by_hand():
    p = plan("mistral-7b-v0.1", context=32768, kv_memory=20 * GiB)
    wa, sf = p["window_aware"], p["sliding_as_full"]
    # Page: 2 x 16 x 8 x 128 x 2 = 65536 B; 32 layers in one group: 2 MiB per block, 10240 blocks.
    assert (wa["block_bytes"], wa["num_blocks"]) == (2 << 20, 10240)
    # ceil(4095 / 16) + 1 = 257 blocks; 10239 // 257 = 39 (39 x 257 = 10023).
    assert (wa["blocks_per_request"], wa["kv_bytes_per_request"], wa["max_concurrency"]) == (257, 257 << 21, 39)
    # Prefill peak: ceil((4095 + 511) / 16) + 1 = 289; 10239 // 289 = 35.
    assert wa["max_concurrency_prefill_peak"] == 35
    # As full: 2048 blocks per request, 10239 // 2048 = 4.
    assert (sf["blocks_per_request"], sf["max_concurrency"]) == (2048, 4)
    assert p["concurrency_ratio"] == 39 / 4


def test_tensor_parallel_halves_the_kv_heads():
    p = plan("gemma-3-27b", context=32768, kv_memory=20 * GiB, tensor_parallel_size=2)
    # 8 KV heads per rank: 65536 B per layer page, 131072 B per block -> 163840 blocks; 163839 // 11930 = 13.
    assert (p["window_aware"]["block_bytes"], p["window_aware"]["max_concurrency"]) == (131072, 13)
    # As full: 62 x 65536 = 4063232 B per block -> 5285 blocks; 5284 // 2048 = 2.
    assert (p["sliding_as_full"]["num_blocks"], p["sliding_as_full"]["max_concurrency"]) == (5285, 2)


def test_budget_derived_from_the_gpu():
    p = plan("gemma-3-27b", context=32768, gpu="H100-80GB")
    # 80e9 x 0.9 activation reserve - 27.4e9 params x 2 bytes = 17.2e9 bytes.
    assert (p["kv_memory_bytes"], p["kv_memory_source"]) == (17_200_000_000, "derived")
    assert p["window_aware"]["num_blocks"] == 17_200_000_000 // 262144 == 65612
    assert p["window_aware"]["max_concurrency"] == 65611 // 11930 == 5
    # Over TP = 2 x PP = 2 each device holds a quarter of the weights: 72e9 - 13.7e9.
    assert plan("gemma-3-27b", context=32768, tensor_parallel_size=2, pipeline_parallel_size=2,
                gpu="H200")["kv_memory_bytes"] == int(141e9 * 0.9 - 54.8e9 / 4)


def test_cli_table_and_json(capsys):
    rc, out, err = run_cli(["--model", "gemma-3-27b", "--kv-memory", "20GiB", "--context", "32768"], capsys)
    assert rc == 0 and err == ""
    assert "52 x sliding(window=1024) + 10 x full" in out
    lines = {line.split("  ")[0]: line.split() for line in out.splitlines()}
    assert lines["max concurrency, decode"][-2:] == ["6", "1"]
    assert lines["units per request, decode"][-2:] == ["11,930", "2,048"]
    assert lines["KV-cache groups (units per block)"][-6:] == ["2", "(26", "+", "5)", "1", "(1)"]
    assert "5.32x less KV per request; concurrency ratio 6.00x" in out
    rc, out, _ = run_cli(["--model", "mistral-7b-v0.1", "--kv-memory", "20GiB", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0
    assert data["window_aware"]["max_concurrency"] == 39 and data["sliding_as_full"]["max_concurrency"] == 4
    assert data["window_aware"]["kv_bytes_per_request"] == 257 << 21


def test_cli_reads_a_config_json(tmp_path, capsys):
    cfg = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 64,
           "vocab_size": 100, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = run_cli(["--model", str(tmp_path), "--kv-memory", "1MiB", "--context", "1024", "--json"], capsys)
    data = json.loads(out)
    # 5 sliding + 1 full; page 2 x 16 x 1 x 32 x 2 = 2048 B; gcd 1 -> units of one layer, widths 5 + 1; 512 units.
    # Per request: 5 x (ceil(63 / 16) + 1 = 5) + 1024 / 16 = 89 blocks; 511 // 89 = 5. As full: 6 x 64; 511 // 384 = 1.
    assert (data["window_aware"]["blocks_per_request"], data["window_aware"]["max_concurrency"]) == (89, 5)
    assert (data["sliding_as_full"]["blocks_per_request"], data["sliding_as_full"]["max_concurrency"]) == (64, 1)


@pytest.mark.parametrize("text, value", [
    ("20GiB", 20 * GiB), ("20gib", 20 * GiB), ("16GB", 16 * 10**9), ("512MiB", 512 << 20), ("1.5GiB", 3 * GiB // 2),
    ("12345", 12345), ("100 B", 100), ("2TiB", 2 << 40), ("64KiB", 65536),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-5GiB", "0", "20XB", "20 GiB GiB", "1e9"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


@pytest.mark.parametrize("argv, match", [
    (["--model", "gemma-3-27b", "--kv-memory", "20XB"], "argument --kv-memory: '20XB' is not a size"),
    (["--model", "gemma-3-27b", "--context", "0"], "argument --context: '0' must be >= 1"),
    (["--model", "gemma-3-27b", "--block-size", "x"], "argument --block-size: 'x' is not an integer"),
    (["--model", "gemma-3-27b", "--tensor-parallel-size", "-2"], "argument --tensor-parallel-size"),
    (["--kv-memory", "20GiB"], "--model"),
])
def test_bad_arguments_exit_with_usage_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli(argv, capsys)
    assert exit_.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--model", "gemma-9"], "known presets: mistral-7b-v0.1, gemma-2-9b"),
    (["--model", "gemma-3-27b", "--gpu", "B200"], "unknown GPU 'B200'; known: H100-80GB, H200, A100-80GB, L40S"),
    (["--model", "gemma-3-27b", "--tensor-parallel-size", "3"], "does not divide num_attention_heads=32"),
    (["--model", "gemma-3-27b", "--pipeline-parallel-size", "4"], "does not divide num_hidden_layers=62"),
    # 111e9 x 2 bytes = 206.75 GiB of weights against 80e9 x 0.9 = 67.06 GiB.
    (["--model", "command-a"], "command-a weights take 206.75 GiB per device with TP=1 x PP=1, more than the "
                               "67.06 GiB one H100-80GB leaves"),
])
def test_bad_models_and_layouts_are_explained(argv, match, capsys):
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and out == ""
    assert match in err and err.startswith("swakv plan: error: ")


def test_malformed_config_names_the_field(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    rc, _, err = run_cli(["--model", str(tmp_path), "--kv-memory", "1GiB"], capsys)
    assert rc == 2 and "num_attention_heads" in err and str(tmp_path) in err
