"""`pagedllm bench`: datasets are deterministic and shaped as asked; runs report what they did."""

import json

import pytest

from pagedllm.entrypoints.bench.datasets import DatasetConfig, load_dataset
from pagedllm.entrypoints.bench.runs import percentile
from pagedllm.entrypoints.cli import main


@pytest.mark.parametrize("name", ["random", "sharegpt-like", "shared-prefix"])
def test_datasets_are_deterministic(name):
    config = DatasetConfig(
        name=name,
        num_prompts=12,
        input_len=20,
        output_len=8,
        range_ratio=0.5,
        num_prefixes=3,
        prefix_len=16,
        seed=4,
    )
    first = load_dataset(config, vocab_size=500, tokenizer=None)
    assert first == load_dataset(config, vocab_size=500, tokenizer=None)
    assert len(first) == 12
    assert all(100 <= t < 500 for r in first for t in r.prompt_token_ids)
    assert first != load_dataset(DatasetConfig(**{**config.__dict__, "seed": 5}), 500, None)


def test_random_lengths_respect_the_range_ratio():
    config = DatasetConfig(num_prompts=200, input_len=100, output_len=40, range_ratio=0.25)
    requests = load_dataset(config, vocab_size=500, tokenizer=None)
    assert all(75 <= len(r.prompt_token_ids) <= 125 for r in requests)
    assert all(30 <= r.output_len <= 50 for r in requests)
    assert len({len(r.prompt_token_ids) for r in requests}) > 10
    fixed = load_dataset(DatasetConfig(num_prompts=5, input_len=7, output_len=3), 500, None)
    assert {(len(r.prompt_token_ids), r.output_len) for r in fixed} == {(7, 3)}


def test_shared_prefix_prompts_share_their_system_prompt():
    config = DatasetConfig(
        name="shared-prefix", num_prompts=8, input_len=5, num_prefixes=2, prefix_len=30
    )
    requests = load_dataset(config, vocab_size=500, tokenizer=None)
    assert requests[0].prompt_token_ids[:30] == requests[2].prompt_token_ids[:30]
    assert requests[0].prompt_token_ids[:30] != requests[1].prompt_token_ids[:30]


def test_file_dataset_reads_text_and_token_prompts(tmp_path):
    class Tokenizer:
        def encode(self, text):
            return [len(word) for word in text.split()]

    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "hello big world", "output_len": 3}\n\n{"prompt_token_ids": [5, 6]}\n'
    )
    requests = load_dataset(
        DatasetConfig(name="file", path=str(path), output_len=9), 500, Tokenizer()
    )
    assert [(r.prompt_token_ids, r.output_len) for r in requests] == [([5, 3, 5], 3), ([5, 6], 9)]
    path.write_text("{not json}\n")
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1"):
        load_dataset(DatasetConfig(name="file", path=str(path)), 500, Tokenizer())


def test_bad_dataset_settings():
    with pytest.raises(ValueError, match="dataset"):
        DatasetConfig(name="sharegpt")
    with pytest.raises(ValueError, match="range_ratio"):
        DatasetConfig(range_ratio=1.5)
    with pytest.raises(ValueError, match="path"):
        DatasetConfig(name="file")


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 3.0], 0) == 1.0 and percentile([1.0, 3.0], 100) == 3.0


def test_bench_throughput_reports_tokens(tiny_llama, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    code = main(
        [
            "bench",
            "throughput",
            "--model",
            str(tiny_llama),
            "--num-prompts",
            "6",
            "--input-len",
            "12",
            "--output-len",
            "5",
            "--max-model-len",
            "64",
            "--output-json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["num_requests"] == 6
    assert report["num_input_tokens"] == 72 and report["num_output_tokens"] == 30
    assert report["requests_per_s"] > 0
    assert "Offline throughput" in capsys.readouterr().out


def test_bench_latency_reports_percentiles(tiny_llama, tmp_path):
    out = tmp_path / "latency.json"
    code = main(
        [
            "bench",
            "latency",
            "--model",
            str(tiny_llama),
            "--batch-size",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--num-iters",
            "3",
            "--num-iters-warmup",
            "1",
            "--max-model-len",
            "64",
            "--output-json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert len(report["latencies_s"]) == 3
    p = report["percentiles_s"]
    assert p["10"] <= p["50"] <= p["99"]
    assert report["per_output_token_ms"]["50"] == pytest.approx(1000 * p["50"] / 4, rel=1e-2)
