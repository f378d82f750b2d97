"""``lambdanet.ops.causal_lambda``: every mode against the definition (App. B.2's masked lambdas, position by
position in float64), the Triton ``fused_chunk`` kernels under Triton's interpreter on CPU tensors.

Tolerances (the issue's figures, and the error analysis behind them): float32 inputs, outputs compared with the
float64 definition of the same (float32-rounded) inputs. Each output is a sum of at most ``n + r`` products of
``k u`` terms accumulated in float32 with every exponent ``<= 0`` (running maxima), so its rounding error is at most
``~(n + r + k u) 2^-24 ~ 3e-5`` of the terms' magnitude for ``n = 500`` (random-sign errors: far less). Outputs
allow ``1e-4``; gradients, which subtract two such sums in the softmax's backward (``V . dN - rho``), ``1e-3``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from lambdanet.functional.causal import causal_lambda_reference
from lambdanet.layers.causal_lambda import CausalLambdaLayer
from lambdanet.ops import MODES, causal_lambda
from lambdanet.ops.causal_lambda import fused_chunk as FC
from lambdanet.ops.causal_lambda import triton_chunk as TC

needs_kernels = pytest.mark.skipif(not FC.available("cpu")[0] and not torch.cuda.is_available(),
                                   reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def inputs(n, b=2, h=3, k=5, v=24, u=2, r=7, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, k, generator=g)
    keys = scale * torch.randn(b, n, k, u, generator=g)
    values = torch.randn(b, n, v, u, generator=g)
    emb = torch.randn(r, k, u, generator=g) if r else None
    return q, keys, values, emb


_REFERENCES: dict = {}


def reference(n, r):
    """The definition in float64 with its gradients for :func:`inputs` (computed once per size: it is slow)."""
    if (n, r) not in _REFERENCES:
        ref_in = [None if t is None else t.double().requires_grad_() for t in inputs(n, r=r)]
        ref = causal_lambda_reference(*ref_in)
        ref.backward(torch.randn(2, n, 3, 24, generator=torch.Generator().manual_seed(1)).double())
        _REFERENCES[n, r] = ref.detach(), ref_in
    return _REFERENCES[n, r]


def run(mode, q, keys, values, emb, upstream, **kw):
    xs = [None if t is None else t.detach().clone().requires_grad_() for t in (q, keys, values, emb)]
    out = causal_lambda(*xs, mode=mode, **kw)
    out.backward(upstream.to(out.dtype))
    return out, [None if t is None else t.grad for t in xs]


@needs_kernels
@pytest.mark.parametrize("mode", ["chunk", "fused_chunk", "fused_recurrent"])
@pytest.mark.parametrize("n,r", [(1, 7), (63, 40), (500, 7), (70, 0)])
def test_every_mode_equals_the_definition_with_gradients(mode, n, r):
    """Awkward sizes: 3 heads (not a power of two), k = 5 < 16, v = 24, u = 2, r = 40 > the chunk (three earlier
    chunks in the position scope), r = 0 (content only), n = 1 and n not a multiple of the chunk. Chunks of 16
    positions, but n = 500 at each mode's default chunk (the kernels': 32 at 3 heads; the PyTorch form's: 64),
    what a call without ``chunk_size`` runs (and half the interpreter's time of chunks of 16)."""
    if mode == "fused_recurrent" and n == 500:
        pytest.skip("the recurrent mode steps through positions one by one (covered at 63)")
    q, keys, values, emb = inputs(n, r=r)
    upstream = torch.randn(2, n, 3, 24, generator=torch.Generator().manual_seed(1))
    ref, ref_in = reference(n, r)
    chunk = 16 if mode != "fused_recurrent" and n < 500 else None
    out, grads = run(mode, q, keys, values, emb, upstream, chunk_size=chunk)
    assert out.shape == ref.shape and rel(out, ref) < 1e-4
    for name, got, t in zip(("q", "keys", "values", "emb"), grads, ref_in):
        if t is not None:  # at n = 1 the keys' gradient is exactly zero: rel() compares absolutely
            assert rel(got, t.grad) < 1e-3, name


@needs_kernels
@pytest.mark.parametrize("products,scans", [((8, 16, 1), (1, 16, 8)), ((4, 256, 2), (2, 32, 4))])
def test_fused_chunk_launch_settings_keep_the_result(monkeypatch, products, scans):
    """Every kernel's launch settings (``fused_chunk.TUNE``: warps, value block, stages) change how the work is
    tiled, never the result: value blocks of 16 split v = 24 into a full and a partial block (the scans then run
    two programs per stream), 256 is capped to the values' width."""
    tune = {k: scans if k in FC.SCANS else products for k in FC.KERNELS}
    monkeypatch.setattr(FC, "TUNE", tune)
    q, keys, values, emb = inputs(63, r=40)
    upstream = torch.randn(2, 63, 3, 24, generator=torch.Generator().manual_seed(1))
    ref, ref_in = reference(63, 40)
    out, grads = run("fused_chunk", q, keys, values, emb, upstream, chunk_size=16)
    assert rel(out, ref) < 1e-4
    for name, got, t in zip(("q", "keys", "values", "emb"), grads, ref_in):
        assert rel(got, t.grad) < 1e-3, name


@needs_kernels
def test_no_kernel_program_reads_or_writes_what_another_of_its_launch_writes(reverse_grid):
    """A launch's programs run at the same time on a GPU, one after another in grid order in Triton's interpreter:
    a program reading an element another program of its launch writes, or two writing one element, would work here
    and race there. In the reverse order every kernel gives the same bits (each program's own arithmetic does not
    depend on the order): the six fused_chunk kernels, forward and backward (3 chunks x 4 streams, scans of 2 and 3
    value blocks per stream, a scope wider than a chunk, a carried state), and the recurrent one (two value blocks
    per stream, which both read the state's z and c)."""

    def continued(q, keys, values, emb, **kw):  # continues a state of finite maxima (an empty one has -inf)
        _, state = causal_lambda(q[:, :5], keys[:, :5], values[:, :5], emb, mode="chunk", output_final_state=True)
        return causal_lambda(q, keys, values, emb, initial_state=state, output_final_state=True, **kw)

    def call():
        xs = [t.clone().requires_grad_() for t in inputs(40, r=40)]
        out, final = continued(*xs, mode="fused_chunk", chunk_size=16)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        y, after = continued(*inputs(9, v=40), mode="fused_recurrent")
        return [out, *final.values(), *(t.grad for t in xs), y, *after.values()]

    in_order = call()
    reverse_grid()
    for a, b in zip(in_order, call(), strict=True):
        assert torch.equal(a, b)


def test_fused_chunk_launch_settings_from_the_environment(monkeypatch):
    for var in [v for v in os.environ if v.startswith("LAMBDANET_CAUSAL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("LAMBDANET_CAUSAL_SCAN_BLOCK_V", "16")
    monkeypatch.setenv("LAMBDANET_CAUSAL_TUNE", "grad_local=8,128,2; chunk_output=0,32,1")
    tune = FC._settings()
    assert tune["grad_local"] == (8, 128, 2) and tune["chunk_output"] == (0, 32, 1)
    assert tune["state_scan"][1] == tune["grad_scan"][1] == 16  # the other settings as they were
    assert tune["state_scan"][::2] == FC.SETTINGS["state_scan"][::2]
    assert tune["grad_scan"][::2] == FC.SETTINGS["grad_scan"][::2]
    assert tune["grad_keys_values"] == FC.SETTINGS["grad_keys_values"]
    for bad in ("grad=8,64,1", "grad_local=8,64"):
        monkeypatch.setenv("LAMBDANET_CAUSAL_TUNE", bad)
        with pytest.raises(ValueError, match="LAMBDANET_CAUSAL_TUNE must be .* got '" + bad):
            FC._settings()
    bad_values = (("grad_local=8,100,1", "block_v"), ("grad_local=3,64,1", "warps"), ("grad_local=8,64,0", "stages"))
    for bad, what in bad_values:
        monkeypatch.setenv("LAMBDANET_CAUSAL_TUNE", bad)
        with pytest.raises(ValueError, match=rf"LAMBDANET_CAUSAL_TUNE \(grad_local\) must be .*\({what}\), got"):
            FC._settings()
    monkeypatch.delenv("LAMBDANET_CAUSAL_TUNE")
    for var, value in (("LAMBDANET_CAUSAL_WARPS", "abc"), ("LAMBDANET_CAUSAL_SCAN_BLOCK_V", "0")):
        monkeypatch.setenv(var, value)
        with pytest.raises(ValueError, match=f"^{var} must be .*, got '{value}'$"):
            FC._settings()
        monkeypatch.delenv(var)


def test_a_bad_launch_knob_fails_the_op_not_the_import():
    """The knobs are read at the first launch: ``import lambdanet`` and every command that never runs the kernels
    work with a bad value in the environment."""
    env = {**os.environ, "LAMBDANET_CAUSAL_WARPS": "abc"}
    code = "import lambdanet; from lambdanet.ops.causal_lambda import fused_chunk as FC; print(FC.TUNE == {})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]


@needs_kernels
@pytest.mark.parametrize("mode", ["chunk", "fused_chunk", "fused_recurrent"])
def test_a_final_state_continues_the_sequence(mode):
    q, keys, values, emb = inputs(90, r=20)
    ref = causal_lambda_reference(*(t.double() for t in (q, keys, values, emb)))
    kw = {"chunk_size": 16} if mode == "fused_chunk" else {}
    o1, s = causal_lambda(q[:, :41], keys[:, :41], values[:, :41], emb, mode=mode, output_final_state=True, **kw)
    o2, s2 = causal_lambda(q[:, 41:], keys[:, 41:], values[:, 41:], emb, mode=mode, initial_state=s,
                           output_final_state=True, **kw)  # fmt: skip
    assert rel(torch.cat([o1, o2], dim=1), ref) < 1e-4
    # the state's size does not depend on the length: S [b, u, k, v], z and c [b, u, k], window [b, u, r - 1, v]
    assert {key: tuple(t.shape) for key, t in s2.items()} == {"S": (2, 2, 5, 24), "z": (2, 2, 5), "c": (2, 2, 5),
                                                              "window": (2, 2, 19, 24)}  # fmt: skip


@needs_kernels
def test_fused_chunk_keys_of_any_range_stay_exact():
    """Keys spread by 400 inside one chunk (exp would overflow float32 at 88): the kernels weight each query's
    context relative to its own running maximum, so nothing overflows and the result stays exact."""
    q, keys, values, emb = inputs(50, u=1, r=5, scale=1.0)
    keys[:, 20] += 400.0
    keys[:, 35] -= 400.0
    upstream = torch.randn(2, 50, 3, 24)
    ref_in = [t.double().requires_grad_() for t in (q, keys, values, emb)]
    causal_lambda_reference(*ref_in).backward(upstream.double())
    out, grads = run("fused_chunk", q, keys, values, emb, upstream, chunk_size=16)
    assert torch.isfinite(out).all() and rel(out, causal_lambda_reference(*(t.detach() for t in ref_in))) < 1e-4
    for got, t in zip(grads, ref_in):
        assert torch.isfinite(got).all() and rel(got, t.grad) < 1e-3


class _Calls:
    """Counts the calls of a Triton helper that a kernel calls (the interpreter looks it up at each call)."""

    def __init__(self, fn, calls, name):
        self.fn, self.calls, self.name = fn, calls, name

    def __call__(self, *args, **kwargs):
        self.calls.append(self.name)
        return self.fn(*args, **kwargs)


@needs_kernels
@pytest.mark.parametrize("rise", [0.0, 29.0, 31.0])
def test_fused_chunk_factors_each_chunk_against_one_reference_unless_its_keys_rise_too_far(monkeypatch, rise):
    """Each chunk's content weights factor against its largest key (products instead of a loop over channels)
    while no query's running maximum lies more than ``MAX_SPREAD`` = 30 below it (the PyTorch form's limit for the
    same factoring); a chunk whose keys rise further takes the exact channel loop, alone. Either way every result
    equals the definition: 29 is the factored form at its edge, 31 the loop."""
    from lambdanet.functional.causal import MAX_SPREAD

    assert MAX_SPREAD == 30.0
    calls: list[str] = []
    for name in ("_content_exact", "_grad_exact", "_keys_exact"):
        monkeypatch.setattr(TC, name, _Calls(getattr(TC, name), calls, name))
    q, keys, values, emb = inputs(40, b=1, u=1, r=5, scale=1.0)
    # chunk 1 (of 3): a key ``rise`` above the running maximum of the chunk's first query, in every channel
    keys[0, 16 + 5] = keys[0, : 16 + 1].amax(dim=0) + rise
    upstream = torch.randn(1, 40, 3, 24, generator=torch.Generator().manual_seed(2))
    ref_in = [t.double().requires_grad_() for t in (q, keys, values, emb)]
    ref = causal_lambda_reference(*ref_in)
    ref.backward(upstream.double())
    out, grads = run("fused_chunk", q, keys, values, emb, upstream, chunk_size=16)
    expected = ["_content_exact", "_grad_exact", "_keys_exact"] if rise > MAX_SPREAD else []
    assert calls == expected  # one chunk of the three, in each of the three kernels
    assert rel(out, ref) < 1e-4
    for got, t in zip(grads, ref_in):
        assert rel(got, t.grad) < 1e-3


@needs_kernels
def test_the_channel_loop_can_be_forced_for_measuring_and_a_bad_limit_is_refused(monkeypatch):
    """``LAMBDANET_CAUSAL_SAFE=-inf`` makes every chunk take the channel loop (the kernels as they were before the
    factored form, for timing both in one run): the same results (two float32 orders of the same sums of at most
    ``C + k`` terms: ~1e-7 apart). A limit above ``MAX_SPREAD`` fails the op with a one-line error naming the
    variable."""
    calls: list[str] = []
    monkeypatch.setattr(TC, "_content_exact", _Calls(TC._content_exact, calls, "_content_exact"))
    q, keys, values, emb = inputs(40, b=1, u=1, r=5)
    upstream = torch.randn(1, 40, 3, 24, generator=torch.Generator().manual_seed(2))
    monkeypatch.setenv("LAMBDANET_CAUSAL_SAFE", "")  # empty: unset, as the other knobs
    factored = run("fused_chunk", q, keys, values, emb, upstream, chunk_size=16)
    assert calls == []
    monkeypatch.setenv("LAMBDANET_CAUSAL_SAFE", "-inf")
    looped = run("fused_chunk", q, keys, values, emb, upstream, chunk_size=16)
    assert calls == ["_content_exact"] * 3  # every chunk
    assert rel(looped[0], factored[0]) < 1e-5
    for a, b in zip(looped[1], factored[1]):
        assert rel(a, b) < 1e-5
    for bad in ("31", "inf", "nan", "many"):
        monkeypatch.setenv("LAMBDANET_CAUSAL_SAFE", bad)
        with pytest.raises(ValueError, match=r"^LAMBDANET_CAUSAL_SAFE must be a number <= 30 .*got") as err:
            causal_lambda(q, keys, values, emb, mode="fused_chunk", chunk_size=16)
        assert "\n" not in str(err.value)


class _Count:
    """Counts the launches of one Triton kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel, counts, name):
        self.kernel, self.counts, self.name = kernel, counts, name

    def __getitem__(self, grid):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return self.kernel[grid]


@needs_kernels
def test_fused_chunk_launches_and_torch_ops_do_not_grow_with_n(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    counts: dict[str, int] = {}
    for name in ("_chunk_sums", "_state_scan", "_chunk_output", "_grad_local", "_grad_scan", "_grad_keys_values"):
        monkeypatch.setattr(TC, name, _Count(getattr(TC, name), counts, name))
    seen = []
    for n in (48, 160):
        counts.clear()
        q, keys, values, emb = inputs(n, u=1, r=20)
        with Ops() as ops:
            run("fused_chunk", q, keys, values, emb, torch.randn(2, n, 3, 24), chunk_size=16)
        seen.append((ops.count, dict(counts)))
    assert seen[0] == seen[1]
    assert seen[0][1] == dict.fromkeys(counts, 1) and len(counts) == 6  # three launches forward, three backward


@needs_kernels
def test_a_training_forward_makes_no_final_state():
    """``CausalLambdaLayer(x)`` (no ``return_state``, as in training) asks the kernels for no final state: the same
    output bit for bit as with it, and none of the state's glue (the window's concatenation and float32 copy); with
    ``return_state`` the state still continues the sequence."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = CausalLambdaLayer(32, heads=2, dim_k=16, r=8, mode="fused_chunk")
    x = torch.randn(2, 40, 32)
    with torch.no_grad(), Ops() as plain:
        y = layer(x)
    with torch.no_grad(), Ops() as stateful:
        y_state, state = layer(x, return_state=True)
    assert torch.equal(y, y_state)
    assert "cat" in stateful.names and "cat" not in plain.names and len(plain.names) < len(stateful.names)
    with torch.no_grad():  # the state is still whole where asked for: the second half continues the first
        first, state = layer(x[:, :17], return_state=True)
        second = layer(x[:, 17:], state)
    assert rel(torch.cat([first, second], 1), y) < 1e-5


@needs_kernels
def test_plain_eager_calls_skip_the_dispatcher_and_equal_the_custom_ops(monkeypatch):
    """A plain eager call runs the kernels through an ``autograd.Function`` (less host time a call: the GPU waits
    on it between short kernels); a dispatch mode, tracer or compiler gets the custom ops, which it can see into.
    Both run the same launches on the same buffers, so they agree bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    q, keys, values, emb = inputs(37, u=1, r=7)
    upstream = torch.randn(2, 37, 3, 24, generator=torch.Generator().manual_seed(3))
    taken, apply = [], FC._Eager.apply
    monkeypatch.setattr(FC._Eager, "apply", lambda *args: taken.append(1) or apply(*args))
    out, grads = run("fused_chunk", q, keys, values, emb, upstream, chunk_size=16)
    assert taken == [1]
    with TorchDispatchMode():
        assert not FC._eager(q)
    class Wrapped(torch.Tensor):  # a tensor subclass (as a DTensor is) goes through the custom ops
        pass

    assert FC._eager(q, torch.nn.Parameter(torch.empty(0))) and not FC._eager(q, torch.empty(0).as_subclass(Wrapped))
    monkeypatch.setattr(FC, "_eager", lambda *tensors: False)
    out_op, grads_op = run("fused_chunk", q, keys, values, emb, upstream, chunk_size=16)
    assert taken == [1]  # the custom ops this time
    assert torch.equal(out, out_op) and all(torch.equal(a, b) for a, b in zip(grads, grads_op))


@needs_kernels
@pytest.mark.parametrize("lambdas", [1, 2])  # 2: one lambda per head, each its own stream of the op
def test_the_layer_runs_every_mode_alike_and_checks_it(lambdas):
    torch.manual_seed(0)
    layer = CausalLambdaLayer(32, heads=2, dim_k=16, r=8, lambdas=lambdas)
    x = torch.randn(2, 37, 32, requires_grad=True)
    outs = {}
    for mode in ("chunk", "fused_chunk", "fused_recurrent"):
        layer.mode = mode
        y = layer(x)
        (g,) = torch.autograd.grad(y.square().sum(), x)
        outs[mode] = (y, g)
    for mode in ("fused_chunk", "fused_recurrent"):
        assert rel(outs[mode][0], outs["chunk"][0]) < 1e-4 and rel(outs[mode][1], outs["chunk"][1]) < 1e-3
    with pytest.raises(ValueError, match="mode must be one of") as err:
        CausalLambdaLayer(32, mode="fast")
    assert "\n" not in str(err.value) and all(m in str(err.value) for m in MODES)


@needs_kernels
def test_fused_chunk_argument_errors_are_one_line():
    q, keys, values, emb = inputs(20)
    with pytest.raises(ValueError, match="chunk_size must be a power of two >= 16"):
        causal_lambda(q, keys, values, emb, mode="fused_chunk", chunk_size=24)
    with pytest.raises(ValueError, match="mode must be one of"):
        causal_lambda(q, keys, values, emb, mode="flash")


STATE_MODES = ["chunk", "fused_recurrent", pytest.param("fused_chunk", marks=needs_kernels)]


@pytest.mark.parametrize("mode", STATE_MODES)
def test_a_state_that_does_not_fit_the_call_is_a_one_line_error_before_any_kernel(mode):
    """A state from another batch size, another scope ``r`` or no state at all (a wrong dict) is refused by its
    shapes, in every mode: the kernels index the state by the call's sizes (a smaller one was read or written out
    of bounds)."""
    q, keys, values, emb = inputs(20, k=4, v=8, u=1, r=3)
    _, one = causal_lambda(q[:1], keys[:1], values[:1], emb, mode="chunk", output_final_state=True)
    _, no_emb = causal_lambda(q, keys, values, None, mode="chunk", output_final_state=True)
    cases = [(one, r"b=2.*S \(1, 1, 4, 8\) \(expected \(2, 1, 4, 8\)\)"),
             (no_emb, r"r=3.*window \(2, 1, 0, 8\) \(expected \(2, 1, 2, 8\)\)"),
             ({"S": one["S"]}, r"^initial_state must be a dict with keys \['S', 'c', 'window', 'z'\]")]  # fmt: skip
    for state, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            causal_lambda(q, keys, values, emb, mode=mode, initial_state=state)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["naive", *STATE_MODES])
def test_every_mode_returns_the_inputs_dtype_and_gives_the_state_no_gradient(mode):
    """One output dtype per input dtype, whichever mode and whether or not a gradient is needed (fla's convention:
    ``o`` in the queries' dtype); the state is a constant of every call (no gradient into the initial state, none
    out of the final one), also for a state made under ``inference_mode``."""
    q, keys, values, emb = (t.bfloat16() for t in inputs(20, k=4, v=8, u=1, r=3))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            xs = [t.clone().requires_grad_(grad) for t in (q, keys, values, emb)]
            assert causal_lambda(*xs, mode=mode).dtype == torch.bfloat16
    if mode == "naive":
        return
    with torch.inference_mode():
        _, state = causal_lambda(q.float(), keys.float(), values.float(), emb.float(), mode="chunk",
                                 output_final_state=True)  # fmt: skip
    held = {key: t.clone().requires_grad_() for key, t in state.items()}
    for given in (state, held):
        xs = [t.float().requires_grad_() for t in (q, keys, values, emb)]
        out, final = causal_lambda(*xs, mode=mode, initial_state=given, output_final_state=True)
        out.sum().backward()
        assert all(x.grad is not None for x in xs) and not any(t.requires_grad for t in final.values())
    assert all(t.grad is None for t in held.values())


@pytest.mark.parametrize("mode", ["naive", "chunk", "fused_recurrent"])
def test_mixed_input_dtypes_compute_in_their_promotion_in_every_mode(mode):
    """float64 queries with float32 keys, values and table: every mode runs (the definition promoted them too) and
    returns the queries' dtype, equal to the all-float64 definition: to float64 rounding where the PyTorch forms
    compute in the promotion, to float32's (~1e-7 over these 20-term sums) where the recurrent kernel runs (its
    products are float32 whatever the inputs: the precision rule)."""
    q, keys, values, emb = inputs(20, k=4, v=8, u=1, r=3)
    want = causal_lambda_reference(q.double(), keys.double(), values.double(), emb.double())
    got = causal_lambda(q.double(), keys, values, emb, mode=mode)
    kernel = mode == "fused_recurrent" and FC.available("cpu")[0]
    assert got.dtype == torch.float64 and rel(got, want) < (1e-5 if kernel else 1e-12)


@pytest.mark.parametrize("mode", ["naive", *STATE_MODES])
@pytest.mark.parametrize("b,n", [(0, 9), (2, 0)])
def test_an_empty_batch_or_sequence_gives_the_empty_result_and_zero_gradients(mode, b, n):
    """``[0, n, ...]`` and ``[b, 0, ...]`` inputs: the empty output in the graph (zero gradients, as any PyTorch op
    on an empty tensor), the state unchanged; the layer alike, with its short convolution's carried projections."""
    q, keys, values, emb = inputs(n, b=b, k=4, v=8, u=1, r=3)
    xs = [t.clone().requires_grad_() for t in (q, keys, values, emb)]
    out = causal_lambda(*xs, mode=mode)
    assert out.shape == (b, n, 3, 8)
    out.sum().backward()
    assert all(x.grad is not None and not x.grad.any() for x in xs)
    layer = CausalLambdaLayer(16, heads=2, dim_k=4, r=3, short_conv=4)
    x = torch.randn(2, 5, 16)
    _, state = layer(x, return_state=True)
    y, after = layer(x[:, :0], state, return_state=True)
    assert y.shape == (2, 0, 16) and all(torch.equal(after[key], state[key]) for key in state)


def test_the_chunk_form_keeps_float32_products_under_float16_autocast():
    """The PyTorch form factors a chunk's weights as ``exp(K - a) exp(a - cm)`` with the second factor up to
    ``e^30`` (``MAX_SPREAD``): float16 products (autocast's choice for a matmul) overflow past ``e^11``. It computes
    in float32 under autocast too (the precision rule), so keys rising 20 nats within a chunk stay within float32
    rounding of the float64 definition."""
    q, keys, values, emb = inputs(40, k=4, v=8, u=1, r=3, scale=0.5)
    keys[:, :, 0, 0] += torch.linspace(0, 20, 40)  # one channel rising 20 inside the first chunk
    want = causal_lambda_reference(*(t.double() for t in (q, keys, values, emb)))
    with torch.autocast("cpu", dtype=torch.float16):
        got = causal_lambda(q, keys, values, emb, mode="chunk")
    assert got.dtype == torch.float32 and torch.isfinite(got).all() and rel(got, want) < 1e-5


def test_naive_mode_refuses_a_state_without_reading_it():
    """The definition starts from an empty context: any ``initial_state`` is refused by its presence, so that the
    check never reads a device tensor back (an all-zero state is refused too)."""
    q, keys, values, emb = inputs(6)
    _, state = causal_lambda(q, keys, values, emb, mode="chunk", output_final_state=True)
    empty = {k: torch.zeros_like(v) for k, v in state.items()}
    for given in (state, empty):
        with pytest.raises(ValueError, match="initial_state must be None with mode='naive'") as err:
            causal_lambda(q, keys, values, emb, mode="naive", initial_state=given)
        assert "\n" not in str(err.value)
    from lambdanet.layers import CausalLambdaLayer  # the layer names its own argument, state

    layer = CausalLambdaLayer(8, heads=2, dim_k=4, r=3, mode="naive")
    _, carried = CausalLambdaLayer(8, heads=2, dim_k=4, r=3)(torch.randn(1, 4, 8), return_state=True)
    with pytest.raises(ValueError, match="^state must be None with mode='naive'"):
        layer(torch.randn(1, 3, 8), carried)


def test_auto_is_the_pytorch_chunk_form_on_the_cpu_and_the_kernels_on_cuda():
    from lambdanet.ops import resolve_mode

    assert resolve_mode("auto", "cpu") == "chunk"
    assert resolve_mode("fused_chunk", "cpu") == "fused_chunk"
    if torch.cuda.is_available():
        assert resolve_mode("auto", "cuda") == "fused_chunk"


def test_auto_takes_the_pytorch_form_where_the_sizes_exceed_the_kernels(monkeypatch):
    """The kernels serve tiles of up to 512 rows of heads x chunk, key depths up to 32 (float32: rows x k up to
    8192) and scopes up to 64 (``fused_chunk.LIMITS``, whose corners compile within an H100's shared memory: the
    slow test below). Beyond them ``"auto"`` takes the PyTorch form on CUDA too, and ``"fused_chunk"`` is a one-line
    error naming what exceeds them."""
    from lambdanet.ops.causal_lambda import call_mode

    bf16, f32 = torch.bfloat16, torch.float32
    assert FC.fits(8, 16, 64, 16, bf16) is None and FC.fits(32, 32, 64, 16, bf16) is None  # the corners
    assert FC.fits(32, 16, 64, 16, f32) is None and FC.fits(16, 32, 64, 16, f32) is None
    assert "r=65" in FC.fits(8, 16, 65, 16, bf16) and "dim_k=33" in FC.fits(8, 33, 64, 16, bf16)
    assert "1024 rows" in FC.fits(33, 16, 64, 16, bf16) and "1024 rows" in FC.fits(8, 16, 64, 128, bf16)
    assert "float32" in FC.fits(32, 32, 64, 16, f32) and FC.fits(3, 5, 7, 32, f32) is None
    assert FC.fits(32, 32, 64, 16, torch.float64) is not None  # float64 runs float32 operands: the same limit
    from lambdanet.ops import resolve_mode

    monkeypatch.setattr(FC, "available", lambda device: (True, ""))  # as on a GPU
    assert resolve_mode("auto", "cuda") == "fused_chunk" and resolve_mode("auto", "cuda", fits=False) == "chunk"
    q = torch.empty(1, 4, 8, 16)  # b n h k
    with pytest.raises(ValueError, match=r"^mode='fused_chunk' does not serve r=65 \(at most 64\); use mode='chunk'"):
        call_mode("fused_chunk", q, 65)
    package = importlib.import_module("lambdanet.ops.causal_lambda")  # (lambdanet.ops.causal_lambda: the function)
    seen: list[bool] = []
    monkeypatch.setattr(package, "resolve_mode", lambda mode, device, fits=True: seen.append(fits) or "chunk")
    call_mode("auto", q, 64)
    call_mode("auto", q, 65)
    assert seen == [True, False]  # the call's sizes decide



def test_more_streams_than_a_grid_axis_holds_take_the_pytorch_form(monkeypatch):
    """The chunk kernels hold the streams (batch x ``dim_u``) on their grids' second axis, which holds at most 65535
    programs on a GPU (the interpreter has no such limit, so this is checked before any launch): more streams make
    ``"auto"`` take the PyTorch form, and ``"fused_chunk"`` a one-line error naming batch x dim_u."""
    from lambdanet.ops import causal_lambda
    from lambdanet.ops.causal_lambda import call_mode

    assert FC.fits(8, 16, 64, 16, torch.bfloat16, streams=65535) is None
    assert "65536 streams (at most 65535" in FC.fits(8, 16, 64, 16, torch.bfloat16, streams=65536)
    package = importlib.import_module("lambdanet.ops.causal_lambda")  # (lambdanet.ops.causal_lambda: the function)
    seen: list[bool] = []
    monkeypatch.setattr(package, "resolve_mode", lambda mode, device, fits=True: seen.append(fits) or mode)
    q = torch.empty(32768, 1, 1, 1)  # b n h k: 65,536 streams with u = 2
    call_mode("auto", q, 0, dim_u=1)
    call_mode("auto", q, 0, dim_u=2)
    assert seen == [True, False]  # the kernels serve 32,768 streams, not 65,536
    keys, values = torch.empty(32768, 1, 1, 2), torch.empty(32768, 1, 1, 2)  # b n k u, b n v u
    with pytest.raises(ValueError, match=r"^mode='fused_chunk' does not serve batch x dim_u = 65536 streams"):
        causal_lambda(q, keys, values, mode="fused_chunk")


def test_auto_takes_the_pytorch_form_for_a_chunk_size_the_kernels_do_not_take(monkeypatch):
    """The kernels' chunks are powers of two >= 16; any other ``chunk_size`` makes ``"auto"`` take the PyTorch form
    (which takes any positive chunk), as the sizes beyond ``LIMITS`` do, and is an error only for ``"fused_chunk"``."""
    from lambdanet.ops.causal_lambda import call_mode

    package = importlib.import_module("lambdanet.ops.causal_lambda")
    seen: list[bool] = []
    monkeypatch.setattr(package, "resolve_mode", lambda mode, device, fits=True: seen.append(fits) or "chunk")
    q = torch.empty(1, 4, 2, 16)  # b n h k
    for chunk in (None, 16, 64, 48, 8, 100):
        call_mode("auto", q, 8, chunk)
    assert seen == [True, True, True, False, False, False]
    for bad in (0, -16, 2.5, True):
        with pytest.raises(ValueError, match=r"^chunk_size must be a positive int or None, got "):
            call_mode("auto", q, 8, bad)


@needs_kernels
@pytest.mark.parametrize("mode,backend", [("chunk", "aot_eager"), ("fused_chunk", "aot_eager"),
                                          ("fused_chunk", "inductor")])  # fmt: skip
def test_the_layer_compiles_as_one_graph_forward_and_backward(mode, backend):
    """``torch.compile(fullgraph=True)``: no graph break (the PyTorch form reads no spread on the host there and
    lets the graph's autograd differentiate it; the kernels are opaque custom ops with fake kernels). Inductor, the
    default backend (``--compile``), also checks that each custom op returns the strides its fake kernel says."""
    torch.manual_seed(0)
    layer = CausalLambdaLayer(32, heads=2, dim_k=16, r=8, mode=mode)
    x = torch.randn(2, 40, 32, requires_grad=True)
    eager = layer(x)
    g_eager = torch.autograd.grad(eager.sum(), [x, layer.emb])
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    out = compiled(x)
    g = torch.autograd.grad(out.sum(), [x, layer.emb])
    assert rel(out, eager) < 1e-5 and rel(g[0], g_eager[0]) < 1e-4 and rel(g[1], g_eager[1]) < 1e-4


@needs_kernels
def test_the_kernels_custom_ops_pass_opcheck():
    """Both custom ops of ``fused_chunk`` (forward, backward) against their fake kernels and autograd registration:
    shapes, dtypes and strides of every output (``torch.library.opcheck``), with and without the position table."""
    from lambdanet.functional.causal import init_causal_lambda_state

    for r in (5, 0):  # two chunks of two streams (u = 2): the interpreter runs each op a few times
        q, keys, values, emb = inputs(20, b=1, h=2, k=4, v=8, r=r)
        st = init_causal_lambda_state(1, 4, 8, 2, r)
        args = (q, keys, values, emb, st["S"], st["z"], st["c"], st["window"], 16)
        fwd, bwd = torch.ops.lambdanet.causal_lambda_chunk_fwd, torch.ops.lambdanet.causal_lambda_chunk_bwd
        grads = tuple(None if t is None else t.clone().requires_grad_() for t in args[:4])
        torch.library.opcheck(fwd, grads + args[4:])
        y, Sb, cb, zb = fwd(*args)
        torch.library.opcheck(bwd, (torch.randn_like(y), q, keys, values, emb, st["window"], Sb, cb, zb, 16))


def test_the_language_models_compile_as_one_graph():
    from lambdanet.models import create_model

    torch.manual_seed(0)
    model = create_model("lambda_lm_nano")
    tokens = torch.randint(0, 256, (2, 40))
    eager = model(tokens)
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(tokens)
    out.float().logsumexp(-1).sum().backward()
    assert rel(out, eager) < 1e-5
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _compile_report(args: str) -> list[dict]:
    """``fused_chunk.compile_report(args)`` in a process without ``TRITON_INTERPRET`` (skips where Triton's
    ``ptxas`` / ``nvdisasm`` are missing)."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("LAMBDANET_CAUSAL")}
    code = ("import json; from lambdanet.ops.causal_lambda.fused_chunk import compile_report; "
            f"print(json.dumps(compile_report({args})))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode and any(t in proc.stderr for t in ("ptxas", "nvdisasm")) and "not found" in proc.stderr:
        pytest.skip("Triton's ptxas / nvdisasm are not available here")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("heads", [8, 16, 32])
def test_fused_chunk_kernels_fit_shared_memory_in_float32_and_at_more_heads(heads):
    """The launch settings were chosen for bf16 at 8 heads (128 rows of heads x chunk, value blocks of up to 256
    columns). float32 operands double each block's shared memory and more heads multiply the tile's rows: at a
    256-column block ``grad_keys_values`` asked 295 KB in float32 at 16 heads, over an H100's 227 KB (a launch
    failure). So the product kernels' tiles keep the measured size, ``rows x block_v <= 128 x 256`` (float32
    ``128 x 64``). Every kernel in both dtypes within the limit (minutes: float32 spills), none starved of
    registers."""
    rows = _compile_report(f"heads={heads}")
    assert len(rows) == 12
    for row in rows:
        assert row["shared_bytes"] <= 232448, row
        if row["kernel"] in ("chunk_output", "grad_local", "grad_keys_values"):  # tiles of heads x chunk rows
            assert heads * 16 * row["block_v"] <= (128 * 64 if row["dtype"] == "fp32" else 128 * 256), row
            # float32: the launch asks for every register (maxnreg); ptxas alone gave chunk_output and grad_local
            # 32 registers and a 10 KB stack (thousands of local loads)
            assert row["registers"] > 32, row


@pytest.mark.slow
@pytest.mark.parametrize("heads, dtype, inside", [
    (32, "bf16", True),  # 512 rows x 32 key channels in half precision
    (16, "fp32", True),  # 256 x 32 = 8192 in float32
    (32, "fp32", False),  # 512 x 32 in float32: beyond the limits
])
def test_the_kernels_limits_are_where_they_stop_fitting_hopper(heads, dtype, inside):
    """The corners of ``fused_chunk.LIMITS`` at the largest scope (r 64, k 32) compile for sm_90 within an H100's
    227 KB of shared memory in every kernel (32 heads at k 16, both dtypes: the test above); one step beyond, float32
    at 32 heads, a kernel asks more, which is why ``fits`` refuses it (minutes: float32 spills)."""
    rows = _compile_report(f"heads={heads}, dim_k=32, r=64, dtypes=({dtype!r},)")
    assert len(rows) == 6
    assert all(row["shared_bytes"] <= 232448 for row in rows) == inside, rows
    assert (FC.fits(heads, 32, 64, 16, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]) is None) == inside


@pytest.mark.slow  # (20-35 s of ptxas: a change to the kernels runs -m slow, CONTRIBUTING.md)
def test_fused_chunk_kernels_compile_for_hopper_within_its_shared_memory():
    """Compiled ahead of time for compute capability 9.0 at ``lambda_lm_base``'s sizes (8 heads, k 16, v 208,
    r 64; bf16 as training runs them): the products on the matrix units, and shared memory within an H100's
    227 KiB per block (a first version asked for 306 KiB and failed to launch on the GPU). The sums and scans do
    not spill registers; the three product kernels may at their launch settings (read from the whole machine code:
    docs/bench/lm_gpu/NOTES.md; measured times, not spill counts, chose the settings). The two
    scans walk the chunks one after another: their loops are software-pipelined (asynchronous copies), since a
    step that waited on each load would cost a memory latency per chunk (2,048 of them at n 32768)."""
    rows = _compile_report("dtypes=('bf16',)")
    assert len(rows) == 6
    for row in rows:
        if row["kernel"] in ("chunk_sums", "state_scan", "grad_scan"):
            assert row["spill_loads"] == 0 and row["spill_stores"] == 0, row
        if row["kernel"] in ("state_scan", "grad_scan"):  # the next chunks' loads in flight, not one latency a step
            assert row["async_loads"] > 0, row
        assert row["shared_bytes"] <= 232448, row
        if row["kernel"] not in ("state_scan", "grad_scan"):
            assert row["mma"] > 0, row


@needs_kernels
@pytest.mark.parametrize("r", [0, 20])
def test_half_operands_stay_within_the_precision_rules_bound(r):
    """The precision rule (docs/language_models.md): the kernels' products take the inputs' dtype as operands and
    accumulate in float32; maxima, exponents, normalisers and states are float32. So, against the float64 definition
    of the same half-precision inputs, each output's error is at most three roundings to the operand format (the
    score or query-times-decay operand, the state operand, the output) of the sum of its terms' magnitudes,
    ``3 u sum |terms|`` with ``u = 2^-11`` (float16), plus float32 accumulation (``~(n + r) 2^-24``, far below).
    ``sum |terms|`` is the definition itself run on ``|q|``, ``|V|``, ``|E|`` (the softmax weights are positive).
    Float16 is used because Triton's interpreter multiplies bf16 operands wrongly (bf16 runs on the GPU's device
    tests); a product in float32 or a lost rounding step would not show, an operand in a coarser format or a
    dropped term would."""
    q, keys, values, emb = inputs(90, u=1, r=r, scale=4.0)
    q, keys, values = q.half(), keys.half(), values.half()
    emb = None if emb is None else emb.half()
    out = causal_lambda(q, keys, values, emb, mode="fused_chunk", chunk_size=16)
    assert out.dtype == torch.float16
    d = [None if t is None else t.double() for t in (q, keys, values, emb)]
    ref = causal_lambda_reference(*d)
    mags = causal_lambda_reference(d[0].abs(), d[1], d[2].abs(), None if emb is None else d[3].abs())
    bound = 3 * 2.0**-11 * mags + 1e-6
    assert ((out.double() - ref).abs() <= bound).all()
    assert (out.double() - ref).abs().max() > 0  # rounded somewhere: the operands really were half precision


def test_the_ops_doc_snippet_runs_verbatim_and_continues_its_sequence():
    """The ``causal_lambda`` block of docs/language_models.md, run as written: the second call continues the first."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "language_models.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "from lambdanet.ops import" in b]
    ns: dict = {}
    exec(compile(code, "docs/language_models.md", "exec"), ns)
    whole = causal_lambda_reference(*(ns[x].double() for x in ("q", "k", "v", "emb")))
    assert rel(torch.cat([ns["o"], ns["o2"]], dim=1), whole) < 1e-5


@needs_kernels
@pytest.mark.parametrize("r", [0, 1, 20])
def test_the_recurrent_kernel_equals_the_definition_and_continues(r):
    """Without gradients ``fused_recurrent`` is one Triton launch per call: 8 heads, v = 208 (seven value blocks,
    which share the key maxima and normalisers they all read first), a call split at an awkward position; r = 20
    is a full and a partial block of 16 offsets and a scope shorter than the sequence (the window slides)."""
    g = torch.Generator().manual_seed(3)
    q, keys, values = torch.randn(2, 30, 8, 16, generator=g), 3 * torch.randn(2, 30, 16, 1, generator=g), None
    values = torch.randn(2, 30, 208, 1, generator=g)
    emb = torch.randn(r, 16, 1, generator=g) if r else None
    ref = causal_lambda_reference(*(None if t is None else t.double() for t in (q, keys, values, emb)))
    with torch.no_grad():
        o1, s = causal_lambda(q[:, :17], keys[:, :17], values[:, :17], emb, mode="fused_recurrent",
                              output_final_state=True)  # fmt: skip
        o2, s2 = causal_lambda(q[:, 17:], keys[:, 17:], values[:, 17:], emb, mode="fused_recurrent",
                               initial_state=s, output_final_state=True)  # fmt: skip
        _, whole = causal_lambda(q, keys, values, emb, mode="chunk", output_final_state=True)
    assert rel(torch.cat([o1, o2], dim=1), ref) < 1e-5
    for key in ("S", "z", "c", "window"):
        assert rel(s2[key], whole[key]) < 1e-5, key


@needs_kernels
def test_a_model_generates_alike_with_the_kernels_and_the_pytorch_step():
    from lambdanet.models import create_model

    torch.manual_seed(0)
    model = create_model("lambda_lm_nano").eval()
    prompt = torch.randint(0, 256, (2, 21))
    with torch.no_grad():
        logits, state = model(prompt, return_state=True)
        outs = {}
        for mode in ("chunk", "fused_chunk"):  # the step follows the layer's mode: PyTorch, or the recurrent kernel
            for block in model.blocks:
                block.mixer.mode = mode
            s, tok, seq = state, logits[:, -1].argmax(-1), []
            for _ in range(6):
                step_logits, s = model.step(s, tok)
                seq.append(step_logits)
                tok = step_logits.argmax(-1)
            outs[mode] = torch.stack(seq, dim=1)
    assert rel(outs["fused_chunk"], outs["chunk"]) < 1e-5


@needs_kernels
def test_the_kernels_serve_the_decayed_layer_with_float32_keys():
    """A decayed layer feeds the op float32 keys (``K + G``) beside half-precision queries and values: the kernels
    take the keys in their own dtype, and agree with the PyTorch form."""
    torch.manual_seed(0)
    layer = CausalLambdaLayer(32, heads=2, dim_k=16, r=8, decay="gate", short_conv=3)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.3)
    x = torch.randn(2, 37, 32, requires_grad=True)
    outs = {}
    for mode in ("chunk", "fused_chunk"):
        layer.mode = mode
        y = layer(x)
        outs[mode] = (y, torch.autograd.grad(y.square().sum(), x)[0])
    assert rel(outs["fused_chunk"][0], outs["chunk"][0]) < 1e-4 and rel(outs["fused_chunk"][1], outs["chunk"][1]) < 1e-3
    q = torch.randn(1, 20, 2, 16).half()
    keys = torch.randn(1, 20, 16, 1) * 3 + torch.arange(20.0)[None, :, None, None]  # float32, growing offsets
    values = torch.randn(1, 20, 24, 1).half()
    out = causal_lambda(q, keys, values, None, mode="fused_chunk", chunk_size=16)
    ref = causal_lambda_reference(q.double(), keys.double(), values.double())
    assert out.dtype == torch.float16 and rel(out, ref) < 3 * 2.0**-11 * 4


def test_auto_keeps_float64_inputs_in_float64_arithmetic(monkeypatch):
    """The kernels' products are float32 whatever the inputs (the precision rule): ``"auto"`` on a GPU takes them
    for float32 / half inputs, the PyTorch chunk form (float64 throughout) for float64 ones, so a float64 gradcheck
    with the default mode holds on any device."""
    from lambdanet.ops.causal_lambda import call_mode

    monkeypatch.setattr(FC, "available", lambda device: (True, ""))  # as on a GPU
    q = torch.empty(1, 4, 8, 16, device="meta")
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    assert call_mode("auto", q, 8) == "fused_chunk" and call_mode("auto", q.to(torch.bfloat16), 8) == "fused_chunk"
    assert call_mode("auto", q.double(), 8) == "chunk"


def test_states_of_another_dtype_device_or_type_are_one_line_errors_in_every_entry():
    """A state is read by the op or the layer deep inside (an integer state gave a wrong output, one on another
    device torch's own message, a number an AttributeError): ``causal_lambda``, the two terms apart and the layer
    each name the argument and what it must be. A state made under ``inference_mode`` continues with autograd on
    (the layer's step and forward alike), equal to the whole sequence."""
    from lambdanet.ops.lambda_terms import content_lambda, init_content_state, init_position_state, position_lambda

    q, keys, values, emb = inputs(6, k=4, v=8, u=1, r=3)
    _, state = causal_lambda(q, keys, values, emb, mode="chunk", output_final_state=True)
    for key, bad, needle in (("S", state["S"].long(), "S must be a floating-point tensor on cpu, got a torch.int64"),
                             ("z", state["z"].to("meta"), "z must be a floating-point tensor on cpu, got a "
                                                          "torch.float32 tensor on meta"),
                             ("c", 1.0, "c must be a floating-point tensor on cpu, got float")):  # fmt: skip
        with pytest.raises(ValueError, match="^initial_state does not fit this call") as err:
            causal_lambda(q, keys, values, emb, mode="chunk", initial_state={**state, key: bad})
        assert needle in str(err.value) and "\n" not in str(err.value)
    content = init_content_state(2, 4, 8, 1)
    window = init_position_state(2, 8, 1, 3)
    for call, good, misfit, needle in (
        (lambda s: content_lambda(q, keys, values, initial_state=s), content, {**content, "ss": torch.zeros(1, 1, 4)},
         r"ss \(1, 1, 4\) \(expected \(2, 1, 4\)\)"),
        (lambda s: content_lambda(q, keys, values, initial_state=s), content, {"S": content["S"]},
         r"keys \['S', 'ss'\]"),
        (lambda s: position_lambda(q, values, emb, initial_state=s), window, {"window": torch.zeros(2, 1, 5, 8)},
         r"window \(2, 1, 5, 8\) \(expected \(2, 1, 2, 8\)\)"),
    ):  # fmt: skip
        call(good)
        with pytest.raises(ValueError, match=needle) as err:
            call(misfit)
        assert str(err.value).startswith("initial_state ") and "\n" not in str(err.value)
    layer = CausalLambdaLayer(16, heads=2, dim_k=4, r=5, short_conv=3, decay="gate")
    x = torch.randn(2, 9, 16)
    with torch.inference_mode():
        _, made = layer(x[:, :8], return_state=True)
    whole = layer(x)
    stepped, _ = layer.step(made, x[:, 8])
    assert torch.allclose(stepped, whole[:, 8], atol=1e-5)  # float32 sums of a few dozen O(1) terms: ~1e-6
    more = layer(x[:, 8:], made)
    assert torch.allclose(more[:, 0], whole[:, 8], atol=1e-5) and more.requires_grad
    with pytest.raises(ValueError, match=r"^state does not fit a batch of 2 in this layer: S must be a floating-point"):
        layer.step({**made, "S": made["S"].long()}, x[:, 8])


def test_the_terms_definitions_of_an_empty_sequence_are_empty_as_their_chunk_forms():
    from lambdanet.ops.lambda_terms import content_lambda, position_lambda
    from lambdanet.ops.lambda_terms.naive import naive_content_lambda, naive_position_lambda

    q, keys, values, emb = inputs(0, k=4, v=8, u=1, r=3)
    for naive, chunked in ((naive_content_lambda(q, keys, values, "l2"), content_lambda(q, keys, values)),
                           (naive_position_lambda(q, values, emb), position_lambda(q, values, emb))):  # fmt: skip
        assert naive.shape == chunked.shape == (2, 0, 3, 8) and naive.dtype == chunked.dtype
