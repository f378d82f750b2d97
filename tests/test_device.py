"""Accelerator tests: every layer and model on the GPU agrees with the CPU, AMP stays finite, the benchmark
harness measures with CUDA events / the caching allocator, and a training run completes on the device.

They run on ``LAMBDANET_TEST_DEVICE`` (default ``cuda``) and are skipped when that device is absent, so the
default suite on a CPU-only machine skips them. ``LAMBDANET_TEST_DEVICE=cpu python -m pytest -m device``
runs the same code on the CPU (the comparisons are then trivially tight; it checks the harness).
Run on a GPU machine: ``python -m pytest -m device``.
"""

import copy
import json
import os

import pytest
import torch

from lambdanet.bench.runner import run_benchmarks
from lambdanet.layers import LambdaLayer, create_spatial_layer, list_spatial_layers, spatial_layer_info
from lambdanet.models import create_model, list_models
from lambdanet.runtime import peak_memory, time_fn, timed_call
from lambdanet.tasks.classification import resolve_config, train

DEVICE = torch.device(os.environ.get("LAMBDANET_TEST_DEVICE", "cuda"))


def _available(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu"


pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not _available(DEVICE), reason=f"no {DEVICE.type} device (LAMBDANET_TEST_DEVICE)")]


def _on_both(module: torch.nn.Module, *inputs: torch.Tensor):
    """Outputs, input gradients and parameter gradients of ``module`` on the CPU and of a copy on DEVICE
    for the same float64 inputs (float64: no TF32, the comparison is exact up to summation order)."""
    results = []
    for device in ("cpu", DEVICE):
        mod = copy.deepcopy(module).double().to(device)
        xs = [x.detach().double().to(device).requires_grad_(x.is_floating_point()) for x in inputs]
        y = mod(*xs)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=device).view_as(y)).sum().backward()
        results.append((y.detach().cpu(), [x.grad.cpu() for x in xs if x.grad is not None],
                        {n: p.grad.cpu() for n, p in mod.named_parameters() if p.grad is not None}))
    return results


def _assert_same(cpu, dev):
    torch.testing.assert_close(dev[0], cpu[0], rtol=1e-7, atol=1e-9)
    for a, b in zip(dev[1], cpu[1]):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    assert dev[2].keys() == cpu[2].keys() and cpu[2]
    for name in cpu[2]:
        torch.testing.assert_close(dev[2][name], cpu[2][name], rtol=1e-6, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}")


LAMBDA_CASES = {
    "local_conv": dict(dim=32, r=7, impl="conv"),
    "local_depthwise": dict(dim=32, r=7, impl="depthwise_conv"),
    "local_einsum": dict(dim=32, r=7, impl="einsum"),
    "local_einsum_qe": dict(dim=32, r=7, impl="einsum_qe"),
    "global_auto": dict(dim=32, r=None, feat_size=12),
    "multi_head_u2": dict(dim=32, r=5, heads=4, dim_u=2, multihead=True),
    "stride2": dict(dim=32, r=5, stride=2),
}


@pytest.mark.parametrize("case", list(LAMBDA_CASES))
def test_lambda_layer_matches_cpu(case):
    kwargs = dict(LAMBDA_CASES[case])
    dim = kwargs.pop("dim")
    layer = LambdaLayer(dim, **kwargs)
    cpu, dev = _on_both(layer, torch.randn(2, dim, 12, 11))
    _assert_same(cpu, dev)


def test_global_lambda_beyond_the_whole_e_bound_matches_cpu():
    """The chunked ``E`` rows (more than 852 positions) on the device, against the CPU."""
    layer = LambdaLayer(16, r=None, feat_size=(30, 29), dim_k=8, heads=2)
    cpu, dev = _on_both(layer, torch.randn(1, 16, 30, 29))
    _assert_same(cpu, dev)


def test_causal_1d_lambda_matches_cpu():
    layer = LambdaLayer(16, r=None, feat_size=24, spatial_dims=1, causal=True)
    cpu, dev = _on_both(layer, torch.randn(2, 16, 24))
    _assert_same(cpu, dev)


@pytest.mark.parametrize("name", list_spatial_layers())
def test_every_spatial_layer_matches_cpu(name):
    feat = 16 if spatial_layer_info(name).needs_feat_size else None
    layer = create_spatial_layer(name, 32, 32, feat_size=feat)
    cpu, dev = _on_both(layer, torch.randn(2, 32, 16, 16))
    _assert_same(cpu, dev)


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("r", [7, None])
def test_lambda_layer_under_autocast_is_finite_and_close_to_fp32(amp, r):
    if DEVICE.type == "cpu" and amp == torch.float16:
        pytest.skip("fp16 autocast is a CUDA setting")
    layer = LambdaLayer(64, r=r, feat_size=16).to(DEVICE)
    x = (3 * torch.randn(4, 64, 16, 16)).to(DEVICE).requires_grad_(True)
    ref = layer(x)
    with torch.autocast(DEVICE.type, dtype=amp):
        y = layer(x)
    y.float().square().mean().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < 0.05, rel


@pytest.mark.parametrize("name", list_models(task="image"))
def test_every_model_trains_a_step_on_device_channels_last_bf16(name):
    model = create_model(name, num_classes=10).to(DEVICE).to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 96, 96, device=DEVICE).contiguous(memory_format=torch.channels_last)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = model(x)
    loss = torch.nn.functional.cross_entropy(y.float(), torch.arange(4, device=DEVICE))
    loss.backward()
    assert y.shape == (4, 10) and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_measurements_on_device():
    size = 64 * 2**20
    assert peak_memory(lambda: torch.empty(size, dtype=torch.uint8, device=DEVICE).fill_(1), DEVICE) >= size
    a = torch.randn(512, 512, device=DEVICE)
    assert timed_call(lambda: a @ a, DEVICE) > 0
    timing = time_fn(lambda: a @ a, DEVICE, repeats=5)
    assert timing.repeats == 5 and timing.q1_s <= timing.median_s <= timing.q3_s


def test_bench_quick_on_device(tmp_path):
    results = run_benchmarks(["targets", "attention", "scaling", "models", "table4"], device=DEVICE.type,
                             quick=True, out=tmp_path, amp="bf16", log=lambda s: None)
    for part in ("targets", "scaling", "models"):
        assert results[part] and (tmp_path / f"{part}.csv").exists()
    rows = json.loads((tmp_path / "models.json").read_text())
    assert {"resnet26", "lambda_resnet26"} <= {r["model"] for r in rows}
    assert DEVICE.type != "cuda" or torch.cuda.get_device_name() in (tmp_path / "bench.md").read_text()


def test_training_run_on_device_learns(tmp_path):
    """Three epochs of the default job (digits, 10 classes, 359 test images) learn. A model that guesses
    scores at most the largest class's share, 47/359 = 0.13, with a standard deviation of at most
    sqrt(0.13 * 0.87 / 359) = 0.018, so 0.5 lies 20 standard deviations above any guessing model."""
    summary = train(resolve_config(overrides=dict(
        epochs=3, batch_size=32, progress=False, tensorboard=False, out=str(tmp_path / "run"),
        device=DEVICE.type, amp="bf16", channels_last=True)))
    assert summary["epochs"] == 3 and summary["final_acc"] > 0.5, summary
    assert (tmp_path / "run" / "model.safetensors").exists()


# the paper's shapes (App. E.1; Table 18): d = 256 inputs at 14x14 with k=16, h=4; a 23x23 local scope (u=1),
# a global context, and the zoo's c5 blocks (u=4, r=7, 7x7 maps)
TRITON_SHAPES = {"local23-u1": (dict(r=23), 14), "global-u1": (dict(r=None, feat_size=14), 14),
                 "local7-u4": (dict(r=7, dim_u=4), 7)}


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the Triton kernels are compiled for CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", TRITON_SHAPES)
def test_triton_kernels_at_the_paper_shapes(name, dtype):
    """impl='triton' against impl='einsum' on the GPU: outputs and gradients. fp32: both accumulate in fp32
    (einsum's GEMMs may use TF32 if enabled: it is not by default), relative error ~ terms * eps32; bf16:
    operands rounded to bf16 (eps 2^-7), so a few eps."""
    kwargs, side = TRITON_SHAPES[name]
    torch.manual_seed(0)
    ref = LambdaLayer(256, 256, dim_k=16, heads=4, impl="einsum", **kwargs).to(DEVICE)
    fused = LambdaLayer(256, 256, dim_k=16, heads=4, impl="triton", **kwargs).to(DEVICE)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(32, 256, side, side, device=DEVICE)
    tol = 1e-3 if dtype == torch.float32 else 4 * 2.0 ** -7
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [m(xi) for m, xi in zip((ref, fused), xs)]
        g = torch.randn_like(ys[0])
        grads = [torch.autograd.grad(y, [xi, *m.parameters()], g) for y, xi, m in zip(ys, xs, (ref, fused))]
    assert (ys[1].float() - ys[0].float()).abs().max() <= tol * ys[0].float().abs().max()
    for a, b in zip(grads[1], grads[0]):
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max() + 1e-6


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the Triton kernels are compiled for CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_op_in_half_precision_against_float64(dtype):
    """The op itself on bf16/fp16 operands (fp32 accumulation) at 14x14, k=16, h=4, v=64, r=23."""
    from lambdanet.ops.position_lambda import lambda_position_output, lambda_position_output_reference

    g = torch.Generator().manual_seed(0)
    q, v, t = (torch.randn(*s, generator=g) for s in ((8, 196, 4, 16), (8, 196, 64, 1), (16, 1, 23, 23)))
    ref = lambda_position_output_reference(q.double(), v.double(), t.double(), (11, 11), (14, 14))
    bound = lambda_position_output_reference(q.double().abs(), v.double().abs(), t.double().abs(), (11, 11), (14, 14))
    y = lambda_position_output(*(x.to(DEVICE, dtype) for x in (q, v, t)), (11, 11), (14, 14)).double().cpu()
    eps = torch.finfo(dtype).eps
    assert ((y - ref).abs() <= 2 * eps * bound + eps * ref.abs() + 1e-5).all()


@pytest.mark.skipif(DEVICE.type != "cuda" or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_kernels_run_on_their_tensors_gpu_whichever_is_current():
    """Triton launches on the current device and its stream: every kernel launch makes its tensors' GPU current,
    so tensors on the second GPU with the first current give the same bits as with the second current (without
    it the first GPU would run them on the second's memory: an illegal address, or reads unordered with the second
    GPU's stream). The causal kernels (forward, backward, recurrent) and the position op (forward, backward)."""
    from lambdanet.ops import causal_lambda
    from lambdanet.ops.position_lambda import lambda_position_output

    g = torch.Generator().manual_seed(0)
    causal = [torch.randn(*s, generator=g) for s in ((2, 40, 3, 5), (2, 40, 5, 2), (2, 40, 24, 2), (7, 5, 2))]
    position = [torch.randn(*s, generator=g) for s in ((2, 54, 3, 4), (2, 54, 12, 2), (4, 2, 3, 3))]

    def run(current: int) -> list[torch.Tensor]:
        with torch.cuda.device(current):
            xs = [t.to("cuda:1").requires_grad_() for t in causal]
            y = causal_lambda(*xs, mode="fused_chunk", chunk_size=16)
            y.backward(torch.linspace(-1, 1, y.numel(), device="cuda:1").view_as(y))
            rec = causal_lambda(*(t.detach() for t in xs), mode="fused_recurrent")
            ps = [t.to("cuda:1").requires_grad_() for t in position]
            p = lambda_position_output(*ps, (1, 1), (6, 9))
            p.backward(torch.linspace(-1, 1, p.numel(), device="cuda:1").view_as(p))
            return [t.detach().cpu() for t in (y, rec, p, *(x.grad for x in xs + ps))]

    for a, b in zip(run(0), run(1), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("name", ["lambda_lm_nano", "linear_lm_nano"])
def test_generation_replayed_from_a_cuda_graph_equals_the_eager_steps(name, amp):
    """The captured step (lambdanet.models.lm_graph) against ``model.step`` on the same tokens (each fed the
    eager arg-max, so one near-tie cannot fork the two), weights far from their initialisation so the logits
    depend on the state: the same kernels on the same values, so float32 agrees to rounding (1e-5 of the
    largest logit) and bf16 autocast to a few bf16 units (4 x 2^-7). The control: the logits one position
    behind (what a state not advanced would give) are far outside that tolerance. In float32
    ``generate(cuda_graph=True)`` gives the greedy tokens of ``generate``; a KV cache is refused."""
    from lambdanet.models.lm_graph import StepGraph

    torch.manual_seed(0)
    model = create_model(name).to(DEVICE).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    prompt = torch.randint(0, 256, (2, 300), device=DEVICE)
    tol = 4 * 2.0**-7 if amp else 1e-5
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        logits, state = model(prompt, return_state=True)
        tok = logits[:, -1].argmax(-1)
        graph = StepGraph(model._advance, state, tok, name=name)
        assert graph.graph is not None
        before = logits[:, -1].float()
        for _ in range(8):
            want, state = model.step(state, tok)
            got = graph.step(tok)
            scale = want.float().abs().max()
            assert (got.float() - want.float()).abs().max() <= tol * scale
            # the control: one position behind (a state not advanced) is far outside the tolerance
            assert (before - want.float()).abs().max() > 10 * tol * scale
            before, tok = want.float(), want.argmax(-1)
        with pytest.raises(ValueError, match="grows"):
            create_model("transformer_lm_nano").to(DEVICE).eval().generate(prompt[:, :5], 3, cuda_graph=True)
    if not amp:
        with torch.no_grad():
            out = model.generate(prompt[:, :50], 40, top_k=1, cuda_graph=True)
        assert torch.equal(out, model.generate(prompt[:, :50], 40, top_k=1))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the Triton kernels are compiled for CUDA")
@pytest.mark.parametrize("which", ["causal", "position"])
def test_inductor_compiles_the_kernels_forward_and_backward(which):
    """``torch.compile`` with inductor, the default backend (what ``--compile`` uses), of a layer whose forward and
    backward are the Triton custom ops (the causal kernels; the position kernel), in one graph: inductor checks the
    strides each op returns against its fake kernel. float32: the compiled graph runs the same kernels on the same
    values, so it agrees with eager to float32 rounding of the surrounding products (relative norms of 1e-5; a
    first try on the CPU, under Triton's interpreter, measured at most 5e-7)."""
    from lambdanet.layers.causal_lambda import CausalLambdaLayer

    torch.manual_seed(0)
    if which == "causal":
        layer, x = CausalLambdaLayer(64, heads=4, dim_k=16, r=8, short_conv=4, decay="fixed"), torch.randn(2, 100, 64)
    else:
        layer, x = LambdaLayer(32, r=7, impl="triton"), torch.randn(2, 32, 12, 11)
    layer, x = layer.to(DEVICE), x.to(DEVICE).requires_grad_()
    params = [x, *layer.parameters()]
    eager = layer(x)
    want = torch.autograd.grad(eager.square().sum(), params)
    torch._dynamo.reset()
    out = torch.compile(layer, fullgraph=True)(x)
    got = torch.autograd.grad(out.square().sum(), params)
    def rel(a, b):
        return float((a - b).norm() / b.norm())

    assert rel(out, eager) < 1e-5
    assert all(rel(a, b) < 1e-5 for a, b in zip(got, want))  # the same kernels: the graph's own sums reordered


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need CUDA")
def test_a_cuda_graph_captures_an_auto_lambda_layer_without_timing_it():
    """``LambdaLayer(impl="auto")`` times its candidates at the first call of a key (measuring tuner): inside a CUDA
    graph capture that synchronised the GPU and ended the capture with CUDA's error. Warmed up without the tuner
    (kernels compiled, cuBLAS set up), then captured with it on: the capture records the static choice, and a replay
    equals an eager call of that choice to float32 rounding (the same implementation on the same values; 1e-5
    relative allows another cuBLAS algorithm's summation order)."""
    from lambdanet.ops.position_lambda.tuning import set_impl_tuning

    torch.manual_seed(0)
    layer = LambdaLayer(32, r=7).to(DEVICE).eval()
    x = torch.randn(4, 32, 12, 11, device=DEVICE)
    previous = set_impl_tuning("static")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            want = layer(x)
        torch.cuda.current_stream().wait_stream(side)
        set_impl_tuning("measure")
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = layer(x)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        set_impl_tuning(previous)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
