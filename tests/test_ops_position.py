"""The position lambdas moved into one op folder, lambdanet/ops/position_lambda/ (issue 36): for one release the old
import paths (lambdanet.functional.fast, lambdanet.kernels and its modules, lambdanet.layers.lambda_policy,
.impl_tuning, .impl_cache, .impl_guard) still import, warn with a DeprecationWarning naming the new path and give
the new modules' very objects; lambdanet.functional (the paper-reading API) and lambdanet.layers export the same
names as before."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lambdanet.functional as functional
import lambdanet.layers as layers
from lambdanet.functional import reference
from lambdanet.layers import lambda_layer, lambda_plan
from lambdanet.ops import position_lambda
from lambdanet.ops.position_lambda import dispatch, fast, fused, naive, policy, tuning
from moved_paths import assert_moved, forget_old_paths

NEW = "lambdanet.ops.position_lambda"
MOVED = {  # old module -> new module
    "lambdanet.functional.fast": f"{NEW}.fast",
    "lambdanet.layers.lambda_policy": f"{NEW}.policy",
    "lambdanet.layers.impl_tuning": f"{NEW}.tuning",
    "lambdanet.layers.impl_cache": f"{NEW}.cache",
    "lambdanet.layers.impl_guard": f"{NEW}.guard",
    "lambdanet.kernels.ops": f"{NEW}.fused",
    "lambdanet.kernels.lambda_position": f"{NEW}.triton_position",
}
# the names lambdanet.functional.fast and lambdanet.kernels exported before the move
OLD_FAST = ["POSITION_IMPLS", "KEY_NORMS", "crop_relative_kernel", "cropped_kernel_size", "gather_relative_embeddings",
            "position_lambdas", "einsum_position_lambdas", "normalize_keys", "content_lambda", "causal_content_lambdas",
            "apply_lambdas", "apply_content_lambda", "permute_copy", "position_output_qe",
            "relative_position_output_qe", "POSITION_OUTPUT_IMPLS", "token_position_lambdas"]
OLD_KERNELS = ["lambda_position_output", "lambda_position_output_reference", "kernels_available"]


@pytest.mark.parametrize("old, new", MOVED.items())
def test_position_old_paths_warn_and_alias(old, new, monkeypatch):
    if new.endswith("triton_position"):
        pytest.importorskip("triton")
    package = "lambdanet.kernels" if old.startswith("lambdanet.kernels.") else old  # only kernels/ moved whole
    assert_moved(old, new, monkeypatch, package, NEW)


def test_the_old_kernels_package_gives_the_new_objects(monkeypatch):
    forget_old_paths(monkeypatch, "lambdanet.kernels")
    with pytest.warns(DeprecationWarning, match=f"lambdanet.kernels moved to {NEW};"):
        import lambdanet.kernels as kernels
    assert all(getattr(kernels, name) is getattr(fused, name) is getattr(position_lambda, name) for name in OLD_KERNELS)


def test_functional_and_layers_export_the_same_names_as_before():
    assert functional.__all__ == [*reference.__all__, *OLD_FAST] and fast.__all__ == OLD_FAST
    assert all(getattr(functional, name) is getattr(fast, name) for name in OLD_FAST)
    assert naive.naive_position_lambdas is reference.compute_position_lambdas is functional.compute_position_lambdas
    assert naive.naive_position_output is fused.lambda_position_output_reference
    for name in ("ImplPolicy", "DEFAULT_IMPL_POLICY", "CUDA_IMPL_POLICY", "impl_policy", "set_impl_policy"):
        assert getattr(lambda_layer, name) is getattr(policy, name) is getattr(position_lambda, name), name
    for name in ("LambdaPlan", "QUERIES_FIRST_STEPS", "LAMBDAS_FIRST_STEPS", "CAUSAL_OP"):
        assert getattr(lambda_plan, name) is getattr(dispatch, name) is getattr(position_lambda, name), name
    for name in ("set_impl_tuning", "impl_tuning_mode", "set_impl_cache_file", "clear_impl_cache"):
        assert getattr(layers, name) is getattr(tuning, name) is getattr(position_lambda, name), name
    assert layers.LambdaPlan is dispatch.LambdaPlan and layers.ImplPolicy is policy.ImplPolicy


def test_the_old_paths_are_the_new_modules_in_a_fresh_interpreter():
    """A process that imports an old path first (the package imports functional, ops and the shims in its own
    order, whichever module is named) gets the new modules under the old names."""
    pairs = {old: new for old, new in MOVED.items() if "triton" not in new}
    code = textwrap.dedent(f"""
        import importlib, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import lambdanet.layers.impl_tuning
        assert any(w.category is DeprecationWarning and "impl_tuning moved to" in str(w.message) for w in caught)
        for old, new in {pairs!r}.items():
            assert importlib.import_module(old) is importlib.import_module(new), old
        import lambdanet.functional as F, lambdanet.ops.position_lambda.naive as N
        assert F.position_lambdas is importlib.import_module("lambdanet.ops.position_lambda").position_lambdas
        assert F.compute_position_lambdas is N.naive_position_lambdas
        print("ok")
    """)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["ok"], proc.stderr[-3000:]
