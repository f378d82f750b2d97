"""The benchmark harness runs on tiny sizes and writes its files; its numbers obey the formulas.
(No timed assertions: speed is reported in BENCHMARKS.md, not tested.)"""

import json
import sys

import pytest
import torch

from lambdanet.bench.layer_bench import geomean, loglog_slope, scaling_slopes
from lambdanet.bench.model_bench import table4_memory
from lambdanet.bench.peers import missing_peers_warning
from lambdanet.bench.runner import run_benchmarks
from lambdanet.cli import main
from lambdanet.runtime import PeakMemory, autocast_context, check_amp, count_flops, peak_memory, time_round_robin


def test_peak_memory_tracker_counts_live_storages():
    with PeakMemory() as tracker:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(2000)  # +8000 B -> peak 12000
        del a
        c = torch.empty(500)  # live 10000
        view = b[10:20]  # a view allocates nothing
    assert tracker.peak == 12000 and c.numel() == 500 and view.numel() == 10


def test_peak_memory_does_not_count_the_tensors_that_existed_before():
    """Views and in-place results of an input or a parameter allocate nothing; a linear layer allocates its output
    alone (the weight's transpose is a view of it): 4 bytes per float32 output element, not its input or weight."""
    x, linear = torch.randn(300, 200), torch.nn.Linear(200, 100)
    assert peak_memory(lambda: x.view(-1)) == 0
    assert peak_memory(lambda: x.t()) == 0
    assert peak_memory(lambda: x.add_(1)) == 0
    assert peak_memory(lambda: linear(x)) == 4 * 300 * 100
    with torch.no_grad():
        assert peak_memory(lambda: linear(x).relu_()) == 4 * 300 * 100


def test_timing_without_a_round_is_a_one_line_error():
    """No timed round has no median (``statistics.StatisticsError`` before): ``repeats`` and ``warmup`` are checked
    by name; one round is enough."""
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"^repeats must be a positive int, got {bad!r}$"):
            time_round_robin({"a": lambda: None}, repeats=bad)
    with pytest.raises(ValueError, match="^warmup must be a non-negative int, got -1$"):
        time_round_robin({"a": lambda: None}, warmup=-1)
    calls = []
    assert time_round_robin({"a": lambda: calls.append(1)}, warmup=0, repeats=1)["a"].repeats == 1 and calls == [1]


def test_flop_counter_counts_two_per_multiply_add():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert count_flops(lambda: a @ b) == 2 * 8 * 16 * 4


def test_flop_counter_matches_the_closed_form_of_a_convolution():
    """A k x k convolution: 2 B C_out H' W' C_in k^2 forward (bias adds are not counted); its backward
    computes the input and the weight gradient, each one more convolution of the same size."""
    conv = torch.nn.Conv2d(6, 10, 3, stride=2)
    x = torch.randn(2, 6, 9, 7, requires_grad=True)
    h_out, w_out = (9 - 3) // 2 + 1, (7 - 3) // 2 + 1  # 4, 3
    forward = 2 * 2 * 10 * h_out * w_out * 6 * 3 * 3
    assert count_flops(lambda: conv(x)) == forward
    assert count_flops(lambda: conv(x).sum().backward()) == 3 * forward


def test_round_robin_timing_shuffles_the_order_each_round():
    """Every round calls each callable once; after the first round (the given order) the order is a seeded
    shuffle, the same in every run, so that no callable always follows the same one."""
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    timings = time_round_robin(fns, warmup=1, repeats=12)
    assert calls[:8] == list("abcd") * 2  # warm-up, then the first round in the given order
    rounds = [calls[i : i + 4] for i in range(4, len(calls), 4)]
    assert len(rounds) == 12 and all(sorted(r) == list("abcd") for r in rounds)
    before = {name: {r[r.index(name) - 1] for r in rounds if r.index(name)} for name in "abcd"}
    assert all(len(v) >= 2 for v in before.values()), before  # each preceded by more than one other
    again = []
    time_round_robin({name: (lambda name=name: again.append(name)) for name in "abcd"}, warmup=1, repeats=12)
    assert again == calls  # seeded: the same order in every run
    assert all(t.repeats == 12 and t.q1_s <= t.median_s <= t.q3_s for t in timings.values())


def test_one_amp_validation_for_every_user(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^amp must be one of \['none', 'bf16', 'fp16'\], got 'fp8'$"):
        check_amp("fp8", "cpu")
    message = "amp='fp16' needs device='cuda', got device='cpu'; use amp='bf16' on CPU"
    with pytest.raises(ValueError, match=message):
        autocast_context(torch.device("cpu"), "fp16")
    with pytest.raises(ValueError, match=message):
        run_benchmarks(["models"], quick=True, out=tmp_path, amp="fp16", log=lambda s: None)
    with autocast_context("cpu", "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast_context("cpu", "none"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_slopes_and_geomean():
    assert loglog_slope([1, 2, 4, 8], [3, 12, 48, 192]) == pytest.approx(2.0)
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)


def test_scaling_slopes_separate_the_batch_shared_term():
    """Rows of a layer whose peak is ``S n^2 + b P n`` (a quadratic term shared by the batch, a linear one per
    example) and time ``t n^1.5``: the total memory slope lies between 1 and 2, the per-example slope is 1."""
    rows = [{"layer": "x", "side": s, "positions": s * s, "batch": b, "fwd_bwd_ms": 0.1 * (s * s) ** 1.5,
             "peak_bytes": 3.0 * (s * s) ** 2 + b * 500.0 * s * s} for s in (8, 16, 32) for b in (1, 4)]
    rows += [{"layer": "single size", "side": 8, "positions": 64, "batch": 1, "fwd_bwd_ms": 1.0, "peak_bytes": 1}]
    (slopes,) = scaling_slopes(rows)
    assert slopes["layer"] == "x" and slopes["batch"] == 1 and slopes["sides"] == 3
    assert slopes["time_slope"] == pytest.approx(1.5)
    assert 1.0 < slopes["memory_slope"] < 2.0
    assert slopes["per_example_slope"] == pytest.approx(1.0)


def test_disagreeing_rounds_and_impossible_orders_are_flagged_not_printed_clean():
    """The issue's case: one round (no spread) and fwd+bwd faster than fwd, then a negative time slope."""
    from lambdanet.bench.layer_bench import MAX_TIMING_SPREAD, timing_flags

    clean = {"median_ms": 10.0, "iqr_ms": 1.0, "repeats": 3}
    assert timing_flags(clean, {"median_ms": 25.0, "iqr_ms": 2.0, "repeats": 3}) == []
    assert "fwd+bwd faster than fwd" in timing_flags(clean, {"median_ms": 8.0, "iqr_ms": 0.5, "repeats": 3})
    wide = {"median_ms": 10.0, "iqr_ms": 10.0 * MAX_TIMING_SPREAD * 1.01, "repeats": 5}
    assert any("rounds spread" in f for f in timing_flags(wide, {"median_ms": 30.0, "iqr_ms": 0.0, "repeats": 5}))
    assert any("no spread" in f for f in timing_flags({"median_ms": 1.0, "iqr_ms": 0.0, "repeats": 1},
                                                       {"median_ms": 3.0, "iqr_ms": 0.0, "repeats": 1}))
    rows = [{"layer": "x", "side": s, "positions": s * s, "batch": 1, "fwd_bwd_ms": t, "peak_bytes": s * s * 100,
             "flags": f} for s, t, f in ((8, 4.0, ""), (12, 1.0, "fwd+bwd faster than fwd"))]
    (slope,) = scaling_slopes(rows)
    assert slope["time_slope"] < 0
    assert "side 12" in slope["flags"] and "time falls" in slope["flags"]
    for r in rows:
        r["flags"] = ""
    rows[1]["fwd_bwd_ms"] = 9.0  # growing time, clean points: no flag
    assert scaling_slopes(rows)[0]["flags"] == ""


def test_table4_memory_follows_the_complexity_formulas():
    """Table 4's memory column, computed by hand from the paper's complexity formulas on ResNet-50's layer
    shapes: 16 spatial layers (blocks 3, 4, 6, 3) at 224x224 see n = 56^2 (3 blocks, and the strided first
    block of stage 2), 28^2 (3 + 1), 14^2 (5 + 1) and 7^2 (2) positions; fp32 (4 bytes), batch b = 128."""
    b, fp32 = 128, 4
    sides = [56] * 4 + [28] * 4 + [14] * 6 + [7] * 2
    n2 = sum((s * s) ** 2 for s in sides)  # sum of n m = n^2 over the layers
    rows = {r["variant"]: r["ours_gb"] * 1e9 for r in table4_memory(batch=b)}
    assert rows["Global self-attention"] == pytest.approx(fp32 * b * 4 * n2)  # Theta(b h n m), h = 4
    # Theta(b h n (H + W)): each position attends its row and its column, h = 8
    assert rows["Axial self-attention"] == pytest.approx(fp32 * b * 8 * sum(s * s * 2 * s for s in sides))
    assert rows["Local self-attention (7x7)"] == pytest.approx(fp32 * b * 8 * sum(s * s * 49 for s in sides))
    # Theta(k n m) with k = 16, |u| = 1, shared by the batch; with shared embeddings once per resolution
    assert rows["Lambda layer"] == pytest.approx(fp32 * 16 * n2)
    assert rows["Lambda layer (shared embeddings)"] == pytest.approx(fp32 * 16 * sum(s ** 4 for s in set(sides)))
    rows = {r["variant"]: r["ours_gb"] for r in table4_memory(batch=b)}
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
    for row in ours:  # the ratio columns are the peers' rows at the same point against ours
        peers = [r for r in results["targets"] if r["impl"] != "lambdanet"
                 and all(r[k] == row[k] for k in ("batch", "channels", "side", "scope"))]
        if not peers:  # the bench extra (timm, lambda-networks) is not installed: no ratio is made up
            assert "fastest_peer" not in row and "ratio_vs_fastest_peer" not in row and "memory_ratio" not in row
            continue
        fastest = min(peers, key=lambda r: r["median_ms"])
        assert row["fastest_peer"] == fastest["impl"]
        assert row["ratio_vs_fastest_peer"] == pytest.approx(fastest["median_ms"] / row["median_ms"])
        assert row["memory_ratio"] == pytest.approx(row["peak_bytes"] / fastest["peak_bytes"])
    rows = json.loads((tmp_path / "scaling.json").read_text())
    assert {r["layer"] for r in rows} == {"global_attention", "local_attention_7x7", "lambda_conv_7x7", "lambda"}
    models = {r["model"]: r for r in results["models"]}
    assert results["models"][0]["model"] == "resnet26"  # the suite's base row
    for r in results["models"]:  # relative throughput: each row's images/s over the base row's
        for mode in ("train", "infer"):
            expected = r[f"{mode}_images_per_s"] / models["resnet26"][f"{mode}_images_per_s"]
            assert r[f"{mode}_relative"] == pytest.approx(expected)
    assert models["lambda_resnet26"]["params"] < models["resnet26"]["params"]
    report = (tmp_path / "bench.md").read_text()
    assert "## LambdaLayer against the peers" in report and "## Table 4 memory" in report


def test_bench_cli_rejects_unknown_parts(tmp_path, capsys):
    assert main(["bench", "speed", "--quick", "--out", str(tmp_path)]) == 2
    assert "unknown bench part(s) ['speed']; valid: targets, impls, attention, scaling, models, table4" in \
        capsys.readouterr().err


def test_a_model_that_asserts_on_a_setting_is_a_failed_row_not_the_end_of_its_suite(monkeypatch):
    """timm's halonet26t asserts that its 8-pixel blocks divide the image (``AssertionError``, at the default 224
    too): ``bench models --suites timm26`` ended with a traceback and wrote nothing, where BENCHMARKS.md promises
    "a row marked failed, not the end of its suite"."""
    from lambdanet.bench import model_bench
    from lambdanet.models.registry import register_model, unregister_model

    class Asserting(torch.nn.Conv2d):
        def forward(self, x):
            assert x.shape[-1] % 7 == 0, ""
            return super().forward(x)

    @register_model
    def test_tmp_asserting(*, num_classes=10, in_chans=3, img_size=None):
        return torch.nn.Sequential(Asserting(in_chans, 4, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                   torch.nn.Linear(4, num_classes))  # fmt: skip

    monkeypatch.setitem(model_bench.MODEL_SUITES, "tmp", [("asserting", "test_tmp_asserting", {}),
                                                          ("mobilenet_v2", "mobilenet_v2", {})])  # fmt: skip
    try:
        rows = model_bench.run_model_suite("tmp", img=32, batch=2, repeats=1, modes=("infer",), log=lambda s: None)
    finally:
        unregister_model("test_tmp_asserting")
    assert rows[0]["error"] == "AssertionError: " and "infer_images_per_s" not in rows[0]
    assert rows[1]["infer_images_per_s"] > 0 and rows[1]["relative_to"] == "mobilenet_v2"


def test_bench_report_of_the_working_folder_and_suites_given_twice(tmp_path, monkeypatch):
    """``--out .`` titled the report ``# lambdanet bench ()``; ``--suites mobilenet mobilenet`` measured the suite
    twice (duplicate rows), where ``--layers`` given twice measures once."""
    folder = tmp_path / "my_bench"
    folder.mkdir()
    monkeypatch.chdir(folder)
    rows = run_benchmarks(["models"], quick=True, out=".", suites=("mobilenet", "mobilenet"), log=lambda s: None)
    assert [r["model"] for r in rows["models"]] == ["mobilenet_v2", "mobilenet_v2_lambda"]
    assert (folder / "bench.md").read_text().startswith("# lambdanet bench (my_bench)\n")


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


def test_bench_without_the_peers_warns_and_keeps_our_rows(tmp_path, capsys, monkeypatch):
    for module in ("timm", "lambda_networks"):  # None in sys.modules: importing it raises ImportError
        monkeypatch.setitem(sys.modules, module, None)
    assert main(["bench", "targets", "--quick", "--out", str(tmp_path)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert "peers not installed: timm, lambda-networks" in err[0]
    assert 'pip install -e ".[bench]"' in err[0] and "pip install timm lambda-networks" in err[0]
    rows = json.loads((tmp_path / "targets.json").read_text())
    assert len(rows) == 2 and {r["impl"] for r in rows} == {"lambdanet"}
    assert "peers not installed: timm, lambda-networks" in (tmp_path / "bench.md").read_text()


def test_missing_peers_warning_names_only_the_missing_ones(monkeypatch):
    monkeypatch.setitem(sys.modules, "lambda_networks", None)
    monkeypatch.setitem(sys.modules, "timm", pytest.importorskip("timm"))
    message = missing_peers_warning({"timm": ["attention"], "lambda_networks": ["targets"]})
    assert message == ('peers not installed: lambda-networks (targets run without their rows); install them with '
                       'pip install -e ".[bench]" or pip install lambda-networks')
    assert missing_peers_warning({"timm": ["attention", "models"]}) is None


def test_bench_scaling_layer_choice(tmp_path, capsys):
    rows = run_benchmarks(["scaling"], quick=True, out=tmp_path, layers=["conv_se", "attention_augmented_conv"],
                          log=lambda s: None)["scaling"]
    assert {r["layer"] for r in rows} == {"conv_se", "attention_augmented_conv"}
    assert all(r["fwd_bwd_ms"] > 0 and r["gflops_fwd_bwd"] > 0 for r in rows)
    assert main(["bench", "scaling", "--quick", "--layers", "conv", "--out", str(tmp_path)]) == 2
    assert "unknown bench layer(s) ['conv']; valid: global_attention," in capsys.readouterr().err


def test_language_model_parts_run_and_their_numbers_obey_the_models(tmp_path):
    """The lm parts on nano models: every family at every context; the lambda and linear models' generation state
    the same size at every context, the transformer's KV cache in proportion to it (2 n d per layer); the
    quality part's rows per budget and seed, the steps budget exactly its steps."""
    results = run_benchmarks(["lm", "lm_quality"], quick=True, out=tmp_path, log=lambda s: None)
    train, gen = results["lm_train"], results["lm_generation"]
    families = ("lambda", "plain_lambda", "transformer", "linear")
    assert {(r["mixer"], r["context"]) for r in train} == {(m, n) for m in families for n in (64, 128)}
    assert all(r["tokens_per_s"] > 0 and r["peak_bytes_one_sequence"] > 0 for r in train)
    state = {(r["mixer"], r["context"]): r["state_bytes"] for r in gen}
    assert all(state[m, 64] == state[m, 256] for m in ("lambda", "plain_lambda", "linear"))
    assert state["lambda", 64] > state["plain_lambda", 64]  # the convolution's last 3 projections
    # the KV cache: 2 layers x (k, v) x n x d (64) x 4 bytes, plus the 8-byte position counter
    assert state["transformer", 64] == 2 * 2 * 64 * 64 * 4 + 8 and state["transformer", 256] == 2 * 2 * 256 * 64 * 4 + 8
    summary = results["lm_quality_summary"]
    assert {(r["budget"], r["mixer"]) for r in summary} == {(b, m) for b in ("time", "steps")
                                                            for m in ("lambda", "transformer", "linear")}
    assert all(r["steps"] == 3 for r in results["lm_quality"] if r["budget"] == "steps")
    assert (tmp_path / "lm_quality.png").is_file() and (tmp_path / "lm_throughput.png").is_file()
    assert "equal time and equal steps" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("side, r", [(5, 3), (7, 23), (6, None), (9, 4), (14, 23), (28, 7)])
def test_kernel_roofline_counts_the_pairs_inside_the_scope(side, r):
    """The roofline's pair count against the reference position output with every input one: y[n] is then
    the number of context positions m whose offset lies in the table, so the sum is the pair count."""
    from lambdanet.bench.kernel_bench import position_counts, scope_pairs
    from lambdanet.ops.position_lambda import lambda_position_output_reference

    t = 2 * side - 1 if r is None else r
    ones = torch.ones(1, side * side, 1, 1, dtype=torch.float64)
    table = torch.ones(1, 1, t, t, dtype=torch.float64)
    y = lambda_position_output_reference(ones, ones, table, (t // 2, t // 2), (side, side))
    assert scope_pairs(side, r) == int(y.sum())
    counts = position_counts(3, side, r, heads=4, dim_k=16, dim_v=8, itemsize=2)
    n = side * side
    assert counts["fwd"]["scores_macs"] == 3 * int(y.sum()) * 4 * 16
    assert counts["fwd"]["matrix_macs"] == 3 * int(y.sum()) * 4 * 8
    # backward: S recomputed and dq on the CUDA cores; dS twice, dV and the table's q^T dS on the matrix units
    assert counts["bwd"]["scores_macs"] == 2 * 3 * int(y.sum()) * 4 * 16
    assert counts["bwd"]["matrix_macs"] == 3 * int(y.sum()) * 4 * (3 * 8 + 16)
    # q, V, table and y once each, 2 bytes an element
    assert counts["fwd"]["bytes"] == 2 * (3 * n * 4 * 16 + 3 * n * 8 + 16 * t * t + 3 * n * 4 * 8)


def test_kernels_part_needs_cuda_and_says_so(tmp_path):
    rows = run_benchmarks(["kernels"], device="cpu", out=tmp_path, log=lambda *_: None)
    assert rows == {} and "Skipped: needs a CUDA device" in (tmp_path / "bench.md").read_text()


def test_layer_parts_run_the_forward_under_the_asked_autocast():
    """``amp`` reaches the layers' forwards (and only them): a probe records autocast inside its forward."""
    from lambdanet.bench.layer_bench import interleaved_fwd_bwd

    class Probe(torch.nn.Conv2d):
        seen: list = []

        def forward(self, x):
            self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return super().forward(x)

    probe = Probe(4, 4, 3, padding=1)
    res = interleaved_fwd_bwd({"probe": probe}, torch.randn(2, 4, 6, 6), repeats=1, warmup=1, amp="bf16")
    assert res["probe"]["median_ms"] > 0 and set(Probe.seen) == {(True, torch.bfloat16)}
    Probe.seen.clear()
    interleaved_fwd_bwd({"probe": probe}, torch.randn(2, 4, 6, 6), repeats=1, warmup=1)
    assert {enabled for enabled, _ in Probe.seen} == {False}


def test_channels_last_conversion_takes_models_with_5d_weights():
    """timm's lambda_resnet26t holds a 5-d Conv3d weight that ``Module.to(memory_format=channels_last)``
    rejects; the bench converts the 4-d tensors instead, and the model computes the same function (float64:
    only the summation order of the convolutions changes, ~1e-15 relative)."""
    timm = pytest.importorskip("timm")
    from lambdanet.bench.model_bench import _to_channels_last

    torch.manual_seed(0)
    model = timm.create_model("lambda_resnet26t", pretrained=False, num_classes=10).double().eval()
    with pytest.raises(RuntimeError, match="rank 4"):
        model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
        _to_channels_last(model)
        after = model(x.contiguous(memory_format=torch.channels_last))
    weights = [p for p in model.parameters() if p.dim() == 4]
    assert weights and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
    assert any(p.dim() == 5 for p in model.parameters())
    torch.testing.assert_close(after, before, atol=1e-10 * before.abs().max().item(), rtol=0)


def test_bench_impls_reports_auto_against_the_fastest_implementation(tmp_path):
    """The impls part times impl="auto" beside every implementation at each point (the grid and the five target
    points; tiny ones here) and reports what it ran and its time over the fastest's, in its rows and bench.md."""
    from lambdanet.bench.layer_bench import IMPL_POINTS, IMPLS_PART_POINTS, TARGET_POINTS
    from lambdanet.layers import LambdaLayer, set_impl_tuning

    assert set(IMPL_POINTS) | set(TARGET_POINTS) == set(IMPLS_PART_POINTS)
    previous = set_impl_tuning("measure")
    try:
        rows = run_benchmarks(["impls"], quick=True, out=tmp_path, log=lambda s: None)["impls"]
    finally:
        set_impl_tuning(previous)
    points = {(r["batch"], r["channels"], r["side"], r["scope"]) for r in rows}
    assert len(points) == 2
    for point in points:
        here = [r for r in rows if (r["batch"], r["channels"], r["side"], r["scope"]) == point]
        explicit = [r for r in here if r["impl"] != "auto"]
        (auto,) = [r for r in here if r["impl"] == "auto"]
        fastest = min(explicit, key=lambda r: r["median_ms"])
        assert auto["fastest_impl"] == fastest["impl"] and [r["impl"] for r in explicit if r["fastest"]] == [
            fastest["impl"]
        ]
        assert auto["auto_over_fastest"] == pytest.approx(auto["median_ms"] / fastest["median_ms"])
        assert [r["impl"] for r in explicit if r["auto"]] == [auto["auto_impl"]]
        b, c, side, scope = point
        r = None if scope == "global" else int(scope.split("x")[0])
        assert auto["static_impl"] == LambdaLayer(c, r=r, feat_size=side).choose_impl((side, side))
    report = (tmp_path / "bench.md").read_text()
    assert "### `auto` against the fastest implementation (tuning mode: measure)" in report
    assert "| auto/fastest |" in report and "points; worst " in report


def test_recall_batches_ask_for_values_seen_and_the_part_runs(tmp_path):
    """Every query repeats a key of the context and its target is that key's value; keys are distinct within a
    sequence; only the queried values are scored. The part runs end to end (quick)."""
    from lambdanet.bench.recall_bench import KEYS, recall_batch

    tokens, target = recall_batch(8, 10, 12, torch.Generator().manual_seed(0))
    assert tokens.shape == (8, 44) and target.shape == (8, 43)
    for t, tg in zip(tokens.tolist(), target.tolist()):
        pairs = dict(zip(t[0:20:2], t[1:20:2]))
        assert len(pairs) == 10 and all(k < KEYS <= v for k, v in pairs.items())
        queries = list(zip(t[20::2], t[21::2]))
        assert all(pairs[k] == v for k, v in queries)
        assert [x for x in tg if x != -100] == [v for _, v in queries]
        assert all(tg[i] == -100 for i in range(19))
    with pytest.raises(ValueError, match="pairs must be in"):
        recall_batch(1, 200, 1, torch.Generator())
    results = run_benchmarks(["lm_recall"], quick=True, out=tmp_path, log=lambda s: None)
    rows = results["lm_recall"]
    assert {r["family"] for r in rows} == {"lambda", "plain_lambda", "linear", "hybrid", "transformer"}
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["reached"] == 2 for r in rows)  # two steps: no promotion
    assert len(results["lm_recall_summary"]) == 5 and "associative recall" in (tmp_path / "bench.md").read_text()


def test_recall_summary_gives_the_mean_the_best_and_the_seeds_that_learnt():
    from lambdanet.bench.recall_bench import summarize_recall

    def row(model, seed, pairs, acc, reached):
        return {"model": model, "seed": seed, "pairs": pairs, "sequence": 4 * pairs, "accuracy": acc,
                "reached": reached, "chance": 1 / 128}  # fmt: skip

    rows = [row("a", 0, 2, 1.0, 4), row("a", 1, 2, 0.5, 2), row("a", 2, 2, 0.9, 4), row("a", 0, 4, 0.95, 4),
            row("b", 0, 2, 0.25, 2)]  # fmt: skip
    got = {(r["model"], r["pairs"]): r for r in summarize_recall(rows)}
    assert set(got) == {("a", 2), ("a", 4), ("b", 2)}
    a2 = got[("a", 2)]
    assert a2["seeds"] == 3 and a2["mean"] == pytest.approx(0.8) and a2["best"] == 1.0
    assert a2["learnt"] == 2 and a2["reached"] == "4/2/4"  # 0.9 counts as learnt
    assert got[("a", 4)]["learnt"] == 1 and got[("b", 2)]["learnt"] == 0


def test_recall_summary_reports_each_model_at_its_best_learning_rate():
    """The learning rate whose mean accuracy over every count and seed is highest, per model; its rows only."""
    from lambdanet.bench.recall_bench import summarize_recall

    def row(model, lr, seed, pairs, acc):
        return {"model": model, "lr": lr, "seed": seed, "pairs": pairs, "sequence": 4 * pairs, "accuracy": acc,
                "reached": pairs, "chance": 1 / 128}  # fmt: skip

    rows = [row("a", 1e-3, 0, 2, 1.0), row("a", 1e-3, 0, 4, 0.2), row("a", 3e-3, 0, 2, 0.7), row("a", 3e-3, 0, 4, 0.6),
            row("b", 1e-3, 0, 2, 0.9), row("b", 3e-3, 0, 2, 0.4)]  # fmt: skip
    got = {(r["model"], r["pairs"]): r for r in summarize_recall(rows)}
    assert set(got) == {("a", 2), ("a", 4), ("b", 2)}
    assert got[("a", 2)]["lr"] == got[("a", 4)]["lr"] == 3e-3  # mean 0.65 against 0.6
    assert got[("a", 2)]["mean"] == 0.7 and got[("b", 2)]["lr"] == 1e-3


def test_pair_curriculum_doubles_the_pairs_once_the_running_accuracy_passes_the_bar():
    """The running accuracy is the exponential mean of the batches at the current count only: with momentum 0.5
    and accuracy 1, it is 1 - 0.5^t after t batches, so 0.9 is passed at the fourth (0.9375); other counts leave
    it alone; the count doubles up to ``top`` and no further; the samples are the current count about half the
    time and never above it."""
    from lambdanet.bench.recall_bench import PairCurriculum

    c = PairCurriculum(6, start=2, promote=0.9, momentum=0.5)
    assert not c.update(1, 1.0, step=0) and c.running == 0.0  # a batch at another count
    assert [c.update(2, 1.0, step=s) for s in range(1, 5)] == [False, False, False, True]
    assert c.pairs == c.reached == 4 and c.running == 0.0 and c.promoted_at == {4: 4}
    assert not any(c.update(4, 0.5, step=s) for s in range(50))  # 0.5 never passes 0.9
    for s in range(4):
        c.update(4, 1.0, step=100 + s)
    assert c.pairs == 6 and c.promoted_at == {4: 4, 6: 102}  # from 0.5: 0.75, 0.875, 0.9375; 8 capped at top
    assert not any(c.update(6, 1.0, step=200 + s) for s in range(10)) and c.pairs == 6
    g = torch.Generator().manual_seed(0)
    drawn = [c.sample(g) for _ in range(2000)]
    assert set(drawn) <= set(range(1, 7)) and 1 in drawn
    share = drawn.count(6) / len(drawn)  # 1/2 + 1/2 * 1/6 = 0.583; 2,000 draws: std 0.011
    assert abs(share - 7 / 12) < 0.05
    with pytest.raises(ValueError, match="start must be in"):
        PairCurriculum(4, start=8)
    with pytest.raises(ValueError, match="promote must be in"):
        PairCurriculum(4, promote=0.0)
