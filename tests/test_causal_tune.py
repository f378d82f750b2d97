"""``lambdanet bench causal_tune``: the sweep of the fused causal lambda's launch settings. Timing needs a GPU; what
the CPU checks is the composition (each kernel's fastest setting, failures left out), the environment string the
op reads back, the variants' coverage and the part's message without a GPU."""

from __future__ import annotations

import pytest

from lambdanet.bench import causal_tune as CT
from lambdanet.ops.causal_lambda.fused_chunk import available
from lambdanet.bench.runner import run_benchmarks
from lambdanet.ops.causal_lambda import fused_chunk as FC


def test_the_variants_try_every_setting_and_keep_scans_and_products_apart():
    tried = CT.variants()
    assert len(tried) == max(len(CT.PRODUCTS), len(CT.SCANS))
    for setting in CT.PRODUCTS:
        assert any(t["grad_local"] == setting for t in tried)
    for setting in CT.SCANS:
        assert any(t["state_scan"] == setting for t in tried)
    for t in tried:
        assert set(t) == set(FC.KERNELS)
        assert all(t[k] in CT.SCANS for k in FC.SCANS)
        assert all(t[k] in CT.PRODUCTS for k in FC.KERNELS if k not in FC.SCANS)


def test_compose_takes_each_kernels_fastest_setting_over_all_points():
    """Three variants timed at two points; each kernel's winner is the least sum over both points (not the best
    at one point), a failed point leaves that variant out, and a kernel never timed keeps the default."""
    tried = [{k: (i, 16 * (i + 1), 1) for k in FC.KERNELS} for i in range(3)]
    ms = {  # kernel: [variant][point]
        "chunk_output": [(1.0, 1.0), (0.5, 2.0), (0.9, 0.9)],  # variant 2: 1.8 (variant 1 wins one point only)
        "grad_local": [(1.0, 1.0), (0.1, 0.1), (3.0, 3.0)],  # variant 1 ...
        "state_scan": [(0.2, 0.2), (0.1, 0.1), (0.3, 0.3)],  # ... but variant 1 fails at the second point below
    }
    rows = []
    for i in range(3):
        row = {p: {k: ms[k][i][j] for k in ms} for j, p in enumerate(("2048x32", "32768x2"))}
        rows.append(row)
    rows[1]["32768x2"] = {"error": "OutOfResources"}  # variant 1 cannot launch at the second point
    default = {k: (9, 64, 1) for k in FC.KERNELS}
    best = CT.compose(rows, tried, default)
    assert best["chunk_output"] == tried[2]["chunk_output"]
    assert best["grad_local"] == tried[0]["grad_local"]  # 1 + 1 < 3 + 3; variant 1 left out
    assert best["state_scan"] == tried[0]["state_scan"]
    assert best["grad_keys_values"] == default["grad_keys_values"]  # never timed


def test_the_printed_setting_is_what_the_op_reads_back(monkeypatch):
    best = {k: v for k, v in zip(FC.KERNELS, [(4, 256, 1), (4, 16, 16), (8, 128, 2), (16, 64, 1), (1, 8, 8),
                                              (0, 32, 1)])}  # fmt: skip
    monkeypatch.setenv("LAMBDANET_CAUSAL_TUNE", CT.tune_env(best))
    assert FC._settings() == best


def test_a_setting_applies_only_while_timed():
    before = dict(FC.tune())
    seen = CT._with({"grad_local": (16, 16, 1)}, lambda: FC.TUNE["grad_local"])
    assert seen == (16, 16, 1) and FC.TUNE == before
    with pytest.raises(RuntimeError):
        CT._with({"grad_local": (16, 16, 1)}, lambda: (_ for _ in ()).throw(RuntimeError("launch failed")))
    assert FC.TUNE == before


def test_without_a_gpu_the_part_says_it_needs_one(tmp_path):
    lines = []
    run_benchmarks(["causal_tune"], device="cpu", out=tmp_path, log=lines.append)
    assert any("--device cuda" in line for line in lines)
    assert "Skipped: needs a CUDA device with Triton." in (tmp_path / "bench.md").read_text()


@pytest.mark.skipif(not available("cpu")[0], reason="the kernels need TRITON_INTERPRET=1 on the CPU")
def test_the_agreement_check_compares_the_tuned_kernels_with_the_defaults():
    """Under Triton's interpreter (float32 arithmetic) other value blocks only reorder float32 sums (the products'
    shapes change, and with them the order BLAS adds in): a relative (RMS) difference delta of about
    sqrt(208) 2^-24 ~ 1e-6 (sums of <= 208 terms whose roundings, 2^-24 each, are random in sign; 208 2^-24 = 1.2e-5
    only if every one aligned). The float32 results (the keys' and the table's gradients, 3e-7 and 3e-8 measured)
    differ by that, bounded by 1e-5. The
    results returned in bf16 (the output, dq, dV) differ where delta moves a value across a bf16 rounding boundary:
    with probability ~2 delta / u per element (u = 2^-8, bf16's relative spacing), by ~u each, so by
    ~sqrt(2 delta u) ~ 9e-5 in norm; bounded by 2e-4. A check that compared a run with itself would give exactly 0
    everywhere, so at least one difference must be non-zero (the tiling really changed)."""
    settings = {k: (1, 8, 2) if k in FC.SCANS else (4, 16, 1) for k in FC.KERNELS}
    agree = CT.agreement(settings, "cpu", n=40, b=1)
    assert set(agree) == {"out", "dq", "dkeys", "dvalues", "demb"}
    assert agree["dkeys"] < 1e-5 and agree["demb"] < 1e-5, agree
    assert all(agree[k] < 2e-4 for k in ("out", "dq", "dvalues")), agree
    assert any(v > 0 for v in agree.values()), agree
