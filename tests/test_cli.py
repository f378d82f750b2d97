"""The command-line interface, run in-process through ``lambdanet.cli.main``."""

import pytest

from lambdanet.cli import main


def test_models_lists_params_flops_and_input_size(capsys):
    assert main(["models", "resnet_rs50*"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| model | params (M) | GFLOPs | input size |"
    rows = {line.split("|")[1].strip(): line for line in out[2:]}
    assert set(rows) == {"resnet_rs50", "resnet_rs50_se"}
    cells = [c.strip() for c in rows["resnet_rs50"].split("|")[1:-1]]
    assert float(cells[1]) == pytest.approx(25.6, abs=0.1) and float(cells[2]) > 4 and cells[3] == "160"


def test_models_unknown_pattern_fails(capsys):
    assert main(["models", "nothing*", "--no-flops"]) == 1
    assert "no registered model matches" in capsys.readouterr().err


def test_demo_runs(capsys):
    assert main(["demo", "--dim", "32", "--size", "8", "--batch", "2"]) == 0
    assert "input (2, 32, 8, 8) -> output (2, 32, 8, 8)" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage: lambdanet" in capsys.readouterr().out
