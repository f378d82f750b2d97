"""The developers' pre-stop guard of `impl="auto"` (scripts/check_auto.py, issue 39): it reads what `lambdanet
bench impls` writes and fails exactly when a point's `auto` is slower than the limit allows."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_auto.py"


def _row(ratio: float, side: int = 14) -> dict:
    return {"batch": 8, "channels": 64, "side": side, "scope": "7x7", "impl": "auto", "auto_impl": "einsum",
            "fastest_impl": "einsum_qe", "auto_over_fastest": ratio}


def _check(tmp_path, rows, *args):
    path = tmp_path / "impls.json"
    path.write_text(json.dumps(rows + [{"impl": "einsum_qe", "median_ms": 1.0}]))
    return subprocess.run([sys.executable, str(SCRIPT), str(path), *args], capture_output=True, text=True)


def test_check_auto_passes_within_the_limit_and_fails_past_it(tmp_path):
    ok = _check(tmp_path, [_row(1.0), _row(1.19, 28)])
    assert ok.returncode == 0 and "2/2 points within 1.2x" in ok.stdout
    bad = _check(tmp_path, [_row(1.0), _row(1.25, 28)])
    assert bad.returncode == 1 and "FAIL B8 C64 28x28" in bad.stdout and "1/2 points" in bad.stdout
    assert _check(tmp_path, [_row(1.25)], "--limit", "1.3").returncode == 0


def test_check_auto_refuses_a_file_without_auto_rows(tmp_path):
    assert _check(tmp_path, []).returncode == 2
