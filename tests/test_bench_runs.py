"""How a ``lambdanet bench`` run keeps its work and reports what it measured: each part written as it ends, a stop
(SIGINT, SIGTERM) that loses no finished part and names what it kept, the long parts' rows kept as they are
measured and taken up again, ``bench.md`` holding every part of its folder, the options ``--quick`` keeps and the
ones no part reads, and one model's failure that does not throw away its suite."""

import json
import math
import os
import signal

import pytest
import torch

from lambdanet.bench import lm_ablation, lm_bench, model_bench, recall_bench, runner
from lambdanet.bench.part import BenchSettings, Part
from lambdanet.bench.report import RowLog, partial_path, write_rows
from lambdanet.cli import main


def _part(name: str, value: int):
    """A part that returns one row ``{"value": value}`` in ``<name>.json`` and a section titled ``name``."""
    return Part(lambda s, out, log: ({name: [{"value": value}]}, [f"## {name}", "", f"value {value}", ""]),
                lambda s: ())  # fmt: skip


def _stops(sig: signal.Signals):
    """A part that stops its run as ``sig`` would, after keeping one row as a long part does."""

    def run(s, out, log):
        RowLog(out, "lm_recall", {"a": 1}).add([{"row": 1}])
        if sig == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), sig)  # the runner's handler raises here
        raise AssertionError("SIGTERM did not stop the part")

    return Part(run, lambda s: ())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_keeps_the_parts_before_it_and_says_what_it_kept(tmp_path, capsys, monkeypatch, sig):
    monkeypatch.setitem(runner.PARTS, "table4", _part("table4", 7))
    monkeypatch.setitem(runner.PARTS, "lm_recall", _stops(sig))
    before = signal.getsignal(signal.SIGTERM)
    assert main(["bench", "table4", "lm_recall", "--out", str(tmp_path)]) == 128 + sig
    assert signal.getsignal(signal.SIGTERM) == before  # the runner's handler is gone again
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"lambdanet bench: stopped by {sig.name} in part lm_recall: table4 written to {tmp_path}; the rows "
                   "of lm_recall measured so far are kept in lm_recall.partial.jsonl: the same command continues"]
    assert json.loads((tmp_path / "table4.json").read_text()) == [{"value": 7}]
    assert "value 7" in (tmp_path / "bench.md").read_text()
    assert RowLog(tmp_path, "lm_recall", {"a": 1}).rows == [{"row": 1}]


def test_bench_md_keeps_the_parts_of_earlier_runs_into_the_folder(tmp_path, monkeypatch):
    monkeypatch.setitem(runner.PARTS, "targets", _part("targets", 1))
    monkeypatch.setitem(runner.PARTS, "table4", _part("table4", 2))
    runner.run_benchmarks(["table4", "targets"], out=tmp_path, log=lambda s: None)
    runner.run_benchmarks(["table4"], out=tmp_path, log=lambda s: None)  # table4 again, with another value
    monkeypatch.setitem(runner.PARTS, "table4", _part("table4", 3))
    runner.run_benchmarks(["table4"], out=tmp_path, log=lambda s: None)
    report = (tmp_path / "bench.md").read_text()
    assert report.index("## targets") < report.index("## table4")  # the table's order
    assert "value 1" in report and "value 3" in report and "value 2" not in report
    assert report.count("_Measured ") == 2 and "device cpu" in report


def test_a_cuda_part_on_the_cpu_leaves_a_section_measured_on_a_gpu_alone(tmp_path, monkeypatch):
    """``kernels`` on the CPU measures nothing: it is skipped (with a warning), not written as "Skipped" over the
    section a GPU run put into the same folder."""
    monkeypatch.setitem(runner.PARTS, "kernels", _part("kernels", 5))
    (tmp_path / "sections").mkdir()
    (tmp_path / "sections" / "kernels.md").write_text("## kernels\n\nmeasured on an H100\n")
    warnings: list[str] = []
    runner.run_benchmarks(["kernels"], out=tmp_path, log=lambda s: None, warn=warnings.append)
    assert warnings == ["lambdanet bench: warning: kernels measures a CUDA device (--device cuda); skipped on the CPU"]
    assert (tmp_path / "sections" / "kernels.md").read_text() == "## kernels\n\nmeasured on an H100\n"
    assert not (tmp_path / "kernels.json").exists()
    monkeypatch.setattr(runner.layer_bench, "triton_runs", lambda device: False)  # a GPU without Triton: the same
    runner.run_benchmarks(["kernels"], device="cuda", out=tmp_path, log=lambda s: None, warn=lambda s: None)
    assert (tmp_path / "sections" / "kernels.md").read_text() == "## kernels\n\nmeasured on an H100\n"


def test_a_report_of_an_earlier_version_is_kept_aside(tmp_path, monkeypatch):
    (tmp_path / "bench.md").write_text("# lambdanet bench (an earlier version)\n")  # no sections/
    monkeypatch.setitem(runner.PARTS, "table4", _part("table4", 2))
    runner.run_benchmarks(["table4"], out=tmp_path, log=lambda s: None)
    assert (tmp_path / "bench_earlier.md").read_text() == "# lambdanet bench (an earlier version)\n"
    assert "value 2" in (tmp_path / "bench.md").read_text()


def test_a_part_that_finishes_removes_its_kept_rows(tmp_path, monkeypatch):
    RowLog(tmp_path, "table4", {}).add([{"old": 1}])
    monkeypatch.setitem(runner.PARTS, "table4", _part("table4", 2))
    runner.run_benchmarks(["table4"], out=tmp_path, log=lambda s: None)
    assert not partial_path(tmp_path, "table4").exists()


def test_kept_rows_come_back_for_the_same_settings_only(tmp_path):
    kept = RowLog(tmp_path, "part", {"steps": 3})
    kept.add([{"seed": 0, "v": 1.0}, {"seed": 0, "v": 2.0}])
    kept.add([{"seed": 1, "v": math.nan}])
    with partial_path(tmp_path, "part").open("a") as f:
        f.write('{"rows": [{"seed": 2, "v"')  # a crash mid-write: that measurement is redone
    again = RowLog(tmp_path, "part", {"steps": 3})
    assert again.done(seed=0) == [{"seed": 0, "v": 1.0}, {"seed": 0, "v": 2.0}]
    assert math.isnan(again.done(seed=1)[0]["v"]) and again.done(seed=2) == []
    again.add([{"seed": 2, "v": 3.0}])  # after the cut line, on a line of its own: kept
    assert RowLog(tmp_path, "part", {"steps": 3}).done(seed=2) == [{"seed": 2, "v": 3.0}]
    other = RowLog(tmp_path, "part", {"steps": 4})  # other settings: started afresh, the first command's set aside
    assert other.done(seed=0) == [] and len(list(tmp_path.glob("part.partial-*.jsonl"))) == 1
    other.add([{"seed": 0, "v": 9.0}])
    back = RowLog(tmp_path, "part", {"steps": 3})  # the first command again: its rows come back, the other's wait
    assert back.done(seed=2) == [{"seed": 2, "v": 3.0}] and len(back.done(seed=0)) == 2
    assert RowLog(tmp_path, "part", {"steps": 4}).done(seed=0) == [{"seed": 0, "v": 9.0}]  # and so on, none lost
    assert RowLog(tmp_path, "part", {"steps": 3}).done(seed=2) == [{"seed": 2, "v": 3.0}]


def test_lm_quality_takes_up_the_runs_it_kept_and_keeps_a_diverged_one(tmp_path, monkeypatch):
    """A row kept by a stopped run is not trained again; a diverged run (NaN, as ``train_run`` reports it) is kept,
    named in the section, and its family's mean is NaN, not the other seeds' mean."""
    calls = []

    def train_run(name, corpus, context, batch, seed, **kw):
        calls.append((name, seed, "steps" if kw["steps"] else "time"))
        bits = math.nan if (name, seed) == ("linear_lm_nano", 1) else 1.0 + seed
        return {"val_bits_per_byte": bits, "steps": 3, "train_s": 0.1}

    monkeypatch.setattr(lm_bench, "train_run", train_run)
    settings = runner.BenchSettings(quick=True)
    from lambdanet.bench.lm_parts import QUALITY_QUICK, lm_quality

    kept = RowLog(tmp_path, "lm_quality", {**QUALITY_QUICK, "device": "cpu", "quick": True})
    row = {"model": "lambda_lm_nano", "mixer": "lambda", "budget": "time", "seed": 0, "context": 64, "batch": 2,
           "val_bits_per_byte": 9.0, "steps": 3, "train_s": 0.1}  # fmt: skip
    kept.add([json.loads(json.dumps(row))])
    rows, lines = lm_quality(settings, tmp_path, lambda s: None)
    assert ("lambda_lm_nano", 0, "time") not in calls and len(calls) == len(rows["lm_quality"]) - 1
    assert row in rows["lm_quality"]
    summary = {(r["budget"], r["mixer"]): r for r in rows["lm_quality_summary"]}
    assert summary[("time", "lambda")]["mean_bits_per_byte"] == pytest.approx((9.0 + 2.0) / 2)
    assert math.isnan(summary[("steps", "linear")]["mean_bits_per_byte"])
    assert any(line.startswith("Diverged (NaN in the means): linear_lm_nano time seed 1") for line in lines)
    write_rows(rows["lm_quality_summary"], tmp_path, "summary")  # NaN is null in the JSON, which has no NaN
    assert None in [r["mean_bits_per_byte"] for r in json.loads((tmp_path / "summary.json").read_text())]


def test_lm_recall_takes_up_the_models_it_kept(tmp_path, monkeypatch):
    kw = dict(families=("linear",), pairs=(2,), steps=1, batch=2, eval_batches=1, seeds=(0, 1), lrs=(1e-3,))
    kept = RowLog(tmp_path, "lm_recall", {"x": 1})
    first = recall_bench.recall(**kw, log=lambda s: None, kept=kept)
    assert len(first) == 2 and len(RowLog(tmp_path, "lm_recall", {"x": 1}).rows) == 2
    monkeypatch.setattr(recall_bench, "create_model", lambda name: pytest.fail("trained a kept model again"))
    again = recall_bench.recall(**kw, log=lambda s: None, kept=RowLog(tmp_path, "lm_recall", {"x": 1}))
    assert again == json.loads(json.dumps(first))


def test_a_diverged_ablation_run_is_kept_shown_and_not_rerun(tmp_path, monkeypatch):
    """``train_run`` stops a diverged run early (fewer steps done, NaN); the study's settings keep the steps asked,
    so the row matches them: a second study does not train it again, and the table says it diverged."""
    calls = []

    def train_run(name, corpus, context, batch, seed, *, steps, **kw):
        calls.append(name)
        diverged = name.startswith("plain_lambda")
        return {"val_bits_per_byte": math.nan if diverged else 2.0, "steps": 1 if diverged else steps, "train_s": 0.0}

    monkeypatch.setattr(lm_ablation, "train_run", train_run)
    kw = dict(size="nano", seeds=(0,), steps=5, context=16, batch=2, eval_bytes=64, log=lambda s: None)
    rows = lm_ablation.study(("transformer", "lambda"), out=tmp_path, **kw)
    assert len(rows) == 2 and len(calls) == 2
    assert lm_ablation.study(("transformer", "lambda"), out=tmp_path, **kw) == rows and len(calls) == 2
    by = {r["config"]: r for r in rows}
    assert by["lambda"]["steps"] == 5 and by["lambda"]["steps_done"] == 1
    table = lm_ablation.summary_table(rows).splitlines()
    assert table[2].startswith("| transformer |") and table[3].startswith("| lambda | ")
    assert "| diverged |" in table[3]


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process start times come from /proc (Linux)")
def test_an_ablation_claim_of_a_reused_process_id_is_taken_over(tmp_path):
    claim = tmp_path / "claims" / "lambda-seed0"
    claim.parent.mkdir()
    parent = os.getppid()  # alive, and not this process
    claim.write_text(f"{parent} {lm_ablation._started(parent)}")
    assert not lm_ablation._claim(claim)  # held by a live process
    claim.write_text(f"{parent} another-boot:1")  # the same id, another process (a reboot, a reused id)
    assert lm_ablation._claim(claim) and claim.read_text().split()[0] == str(os.getpid())
    claim.write_text(str(parent))  # a claim of an earlier version: the id alone
    assert not lm_ablation._claim(claim)


def test_an_ablation_part_with_every_run_held_elsewhere_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(lm_ablation, "_claim", lambda claim: False)
    monkeypatch.setattr(lm_ablation, "train_run", lambda *a, **k: pytest.fail("ran a claimed run"))
    from lambdanet.bench.lm_parts import lm_ablation_part

    rows, lines = lm_ablation_part(BenchSettings(quick=True), tmp_path, lambda s: None)
    assert rows == {}
    assert any(line.startswith("**Incomplete:**") and "transformer seed 0, lambda seed 0" in line for line in lines)


def test_quick_keeps_the_options_given_and_warns_of_options_no_part_reads(tmp_path, monkeypatch):
    seen = {}

    def suite(name, *, img, batch, **kw):
        seen[name] = (img, batch)
        return [{"suite": name, "model": "m", "params": 1}]

    monkeypatch.setattr(model_bench, "run_model_suite", suite)
    warnings: list[str] = []
    runner.run_benchmarks(["models"], quick=True, out=tmp_path, suites=["mobilenet"], img_size=64, repeats=3,
                          log=lambda s: None, warn=warnings.append)  # fmt: skip
    assert seen == {"mobilenet": (64, 2)}  # the size given, the quick batch
    assert warnings == ["lambdanet bench: warning: --repeats is read by targets, impls, attention, none of which "
                        "runs; ignored"]  # fmt: skip
    runner.run_benchmarks(["models"], quick=True, out=tmp_path, log=lambda s: None, warn=warnings.append)
    assert seen["hybrid26"] == (32, 2) and len(warnings) == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, where no folder can be made (Linux)")
def test_an_output_folder_that_cannot_be_written_is_one_line_before_any_work(capsys):
    assert main(["bench", "table4", "--out", "/proc/lambdanet-bench"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lambdanet bench: error: --out /proc/lambdanet-bench: cannot write there (")
    assert "\n" not in err


def test_a_model_that_cannot_run_is_a_failed_row_and_the_suite_goes_on(monkeypatch):
    """torch's error for batch norm over one value per channel (``--batch-size 1`` at a tiny ``--img-size``) on the
    suite's second model: its row says so, the first keeps its numbers and is named as the ratios' baseline."""
    built, runs = [], [0]  # the index of the model that runs (each is timed right after it is built)

    def bench_model(model, img, batch, **kw):
        if model is not built[-1] or len(built) - 1 != runs[0]:
            raise ValueError("Expected more than 1 value per channel when training, got input size [1, 64, 1, 1]")
        return {"images_per_s": 10.0, "batch": batch, "peak_bytes": 1}

    real_build = model_bench._build
    monkeypatch.setattr(model_bench, "_build", lambda *a: built.append(real_build(*a)) or built[-1])
    monkeypatch.setattr(model_bench, "bench_model", bench_model)
    rows = model_bench.run_model_suite("mobilenet", img=32, batch=1, log=lambda s: None)
    assert [r["model"] for r in rows] == ["mobilenet_v2", "mobilenet_v2_lambda"]
    assert "error" not in rows[0] and rows[0]["train_relative"] == 1.0
    assert rows[1]["error"] == "ValueError: Expected more than 1 value per channel when training, got input size " \
        "[1, 64, 1, 1]"
    assert all(r["gflops"] > 0 and r["relative_to"] == "mobilenet_v2" for r in rows)
    built.clear()
    runs[0] = 1  # now the first model fails: the ratios are to the second, the first that ran
    rows = model_bench.run_model_suite("mobilenet", img=32, batch=1, log=lambda s: None)
    assert "error" in rows[0] and rows[1]["relative_to"] == "mobilenet_v2_lambda" and rows[1]["train_relative"] == 1.0


def test_the_cpu_allocator_running_out_halves_the_batch(monkeypatch):
    """The CPU allocator's failure (not CUDA's "out of memory") halves the batch too, also where the input
    itself does not fit."""
    seen = []
    real_randn = torch.randn

    def randn(*shape, **kw):
        seen.append(shape[0])
        if shape[0] > 2:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 8589934592 bytes")  # fmt: skip
        return real_randn(*shape, **kw)

    monkeypatch.setattr(model_bench.torch, "randn", randn)
    classes = 1000  # bench_model draws labels among 1000
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, classes))
    res = model_bench.bench_model(model, 8, 16, repeats=1)
    assert seen == [16, 8, 4, 2] and res["batch"] == 2


def test_a_broken_peer_install_counts_as_missing(monkeypatch):
    import importlib

    from lambdanet.bench import peers

    real = importlib.import_module

    def broken(name, *a, **k):
        if name == "timm":
            raise AttributeError("module 'torch' has no attribute 'something_new'")
        return real(name, *a, **k)

    monkeypatch.setattr(peers.importlib, "import_module", broken)
    assert peers.available_peers(["timm"]) == {"timm": False}


def test_a_layer_named_twice_is_measured_once():
    options = {**dict.fromkeys(runner.OPTION_DEFAULTS), "layers": ["lambda", "conv_3x3", "lambda"]}
    s = runner._settings(["scaling"], "cpu", True, options, print)
    assert s.layers == ("lambda", "conv_3x3") and s.given == {"layers"}


def test_impls_takes_up_the_points_it_kept(tmp_path, monkeypatch):
    from lambdanet.bench import layer_bench

    points = [(2, 16, 6, 3)]
    first = layer_bench.lambda_impls(points, repeats=1, log=lambda s: None, kept=RowLog(tmp_path, "impls", {"a": 1}))
    assert {r["impl"] for r in first} >= {"auto", "einsum", "conv"}
    monkeypatch.setattr(layer_bench, "interleaved_fwd_bwd", lambda *a, **k: pytest.fail("measured a kept point"))
    again = layer_bench.lambda_impls(points, repeats=1, log=lambda s: None, kept=RowLog(tmp_path, "impls", {"a": 1}))
    assert again == json.loads(json.dumps(first))
