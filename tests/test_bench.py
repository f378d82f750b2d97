"""The benchmark harness runs on tiny sizes and writes its files; its numbers obey the formulas.
(No timed assertions: speed is reported in BENCHMARKS.md, not tested.)"""

import json

import pytest
import torch

from lambdanet.bench import PeakMemory, count_flops
from lambdanet.bench.layers import geomean, loglog_slope
from lambdanet.bench.models import table4_memory
from lambdanet.bench.runner import run_benchmarks
from lambdanet.cli import main


def test_peak_memory_tracker_counts_live_storages():
    with PeakMemory() as tracker:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(2000)  # +8000 B -> peak 12000
        del a
        c = torch.empty(500)  # live 10000
        view = b[10:20]  # a view allocates nothing
    assert tracker.peak == 12000 and c.numel() == 500 and view.numel() == 10


def test_flop_counter_counts_two_per_multiply_add():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert count_flops(lambda: a @ b) == 2 * 8 * 16 * 4


def test_slopes_and_geomean():
    assert loglog_slope([1, 2, 4, 8], [3, 12, 48, 192]) == pytest.approx(2.0)
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)


def test_table4_memory_follows_the_complexity_formulas():
    rows = {r["variant"]: r["ours_gb"] for r in table4_memory(batch=128)}
    assert rows["Global self-attention"] > 10 * rows["Axial self-attention"] > 10 * rows["Lambda layer"] / 10
    assert rows["Lambda layer (|k|=8)"] == pytest.approx(rows["Lambda layer"] / 2)  # Theta(l k n^2)
    assert rows["Lambda layer (shared embeddings)"] < rows["Lambda layer"] / 3
    assert rows["Lambda convolution (7x7)"] == 0.0  # no n x m tensor at all
    doubled = {r["variant"]: r["ours_gb"] for r in table4_memory(batch=256)}
    assert doubled["Global self-attention"] == pytest.approx(2 * rows["Global self-attention"])  # per example
    assert doubled["Lambda layer"] == pytest.approx(rows["Lambda layer"])  # shared by the batch


def test_bench_runs_on_tiny_sizes_and_writes_its_files(tmp_path):
    results = run_benchmarks(["targets", "attention", "scaling", "models", "table4"], quick=True, out=tmp_path,
                             log=lambda s: None)
    for part in ("targets", "scaling", "models", "table4"):
        assert (tmp_path / f"{part}.json").exists() and (tmp_path / f"{part}.csv").exists()
        assert results[part]
    assert (tmp_path / "scaling_time.png").exists() and (tmp_path / "scaling_memory.png").exists()
    ours = [r for r in results["targets"] if r["impl"] == "lambdanet"]
    assert len(ours) == 2 and all(r["median_ms"] > 0 and r["peak_bytes"] > 0 and r["flops"] > 0 for r in ours)
    rows = json.loads((tmp_path / "scaling.json").read_text())
    assert {r["layer"] for r in rows} == {"global_attention", "local_attention_7x7", "lambda_conv_7x7", "lambda"}
    models = {r["model"]: r for r in results["models"]}
    assert models["resnet26"]["train_relative"] == pytest.approx(1.0)
    assert models["lambda_resnet26"]["params"] < models["resnet26"]["params"]
    report = (tmp_path / "bench.md").read_text()
    assert "## LambdaLayer against the peers" in report and "## Table 4 memory" in report


def test_bench_cli_rejects_unknown_parts(tmp_path, capsys):
    assert main(["bench", "speed", "--quick", "--out", str(tmp_path)]) == 2
    assert "unknown bench part(s) ['speed']; valid: targets, attention, scaling, models, table4" in \
        capsys.readouterr().err


def test_bench_models_with_bf16_autocast_and_channels_last(tmp_path):
    rows = run_benchmarks(["models"], quick=True, out=tmp_path, amp="bf16", channels_last=True,
                          log=lambda s: None)["models"]
    ours = {r["model"]: r for r in rows if not r["model"].startswith("timm:")}
    assert set(ours) == {"resnet26", "lambda_resnet26"}
    for r in ours.values():
        assert r["amp"] == "bf16" and r["channels_last"] and r["train_images_per_s"] > 0 and r["infer_images_per_s"] > 0
    assert "Precision bf16 autocast, channels_last, eager." in (tmp_path / "bench.md").read_text()


def test_bench_rejects_fp16_without_cuda(tmp_path, capsys):
    assert main(["bench", "models", "--quick", "--amp", "fp16", "--out", str(tmp_path)]) == 2
    assert "amp='fp16' needs device='cuda'" in capsys.readouterr().err


def test_bench_scaling_layer_choice(tmp_path, capsys):
    rows = run_benchmarks(["scaling"], quick=True, out=tmp_path, layers=["conv_se", "attention_augmented_conv"],
                          log=lambda s: None)["scaling"]
    assert {r["layer"] for r in rows} == {"conv_se", "attention_augmented_conv"}
    assert all(r["fwd_bwd_ms"] > 0 and r["gflops_fwd_bwd"] > 0 for r in rows)
    assert main(["bench", "scaling", "--quick", "--layers", "conv", "--out", str(tmp_path)]) == 2
    assert "unknown bench layer(s) ['conv']; valid: global_attention," in capsys.readouterr().err
