"""Half-precision models: every registered model converted with ``.half()`` / ``.to(torch.bfloat16)`` runs
forward in eval and train mode, finite, and within the rounding error its format allows of the float64 model.

The bound. In float16 / bfloat16 every stored number carries a relative rounding error of at most the unit
roundoff ``u`` (2^-11 and 2^-8): the weights and the input once, and the output of every operation (CPU
kernels accumulate their dot products in float32, whose own error over a reduction of ``L`` <= 10^4 terms,
about ``sqrt(L) 2^-24``, is below ``u / 50``: the reduction lengths add nothing that counts; the lambda
layers and attention baselines compute their softmaxes and lambdas in float32 from half-precision
projections). The standard model of rounding, ``fl(x) = x (1 + d)`` with ``|d| <= u``, turns the half model
into the float64 model with those relative perturbations. So the float64 model is run once more with every
parameter, the input and the output of every leaf module multiplied by ``1 + u s`` (``s`` = +-1 at random,
the largest rounding error the format can make): its distance from the unperturbed float64 output,
``e_u``, is the error the format's precision implies through this network, however the network amplifies
it (deep random networks in train mode do, by a factor that depends on the model, not on the format). Actual
rounding errors are at most ``u`` and of random sign, so the half model must land within a small multiple
of ``e_u``: 4, the usual margin of a probabilistic rounding bound (Higham and Mary, 2019: the sum of ``n``
independent errors of size at most ``u`` stays below ``lambda sqrt(n) u`` with probability
``1 - 2 exp(-lambda^2 / 2)``, 0.9993 at ``lambda = 4``). A half-precision defect (an operation on the
wrong dtype, a sum accumulated in half precision, an overflow, a path that drops a term) gives errors of
order one, far beyond it.

The models run as initialised (BatchNorm statistics untouched: eval mode normalises nothing), but for the last
norm of each residual branch, zero after ``zero_init_last``, whose scale is set to 0.2 so that every layer reaches
the output, and without dropout (see :func:`calibrated`). Where the float64 values of a mode do not fit a format
(eval-mode MobileNet logits of 1e-10, below float16's smallest normal number; 200-layer stacks past float16's
largest, 65504, in eval mode) the format, not the implementation, decides the output, and that mode is not
compared in that format (:func:`out_of_range`).
"""

import math

import pytest
import torch
from torch import nn

from lambdanet.models import list_models

from test_models import DEEP_MODELS, DEPTH_REPEATS, build_small, slow_repeats

UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
MARGIN = 4.0
SIZE, BATCH = 64, 4
BRANCH_SCALE = 0.2


def calibrated(name: str) -> nn.Module:
    """The small float64 variant of ``name`` as initialised, but for the residual branches ``zero_init_last``
    silenced: their last norm's scale is 0.2 instead of 0, so that every layer reaches the output; and without
    dropout: in train mode it draws a new mask on every call, so the float64 reference, its perturbed run and the
    half model would each drop other features (MobileNetV2's head, p = 0.2: the float64 model twice differs by
    0.48 of its output, and ``e_u`` measured the masks, admitting any half-precision error below 2)."""
    model = build_small(name, num_classes=10).double().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.p = 0.0
            weight = getattr(m, "weight", None)
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)) and \
                    weight is not None and bool((weight == 0).all()):
                weight.fill_(BRANCH_SCALE)
    return model


def perturbed_output(model: nn.Module, x: torch.Tensor, u: float, seed: int) -> torch.Tensor:
    """``model(x)`` in float64 with every parameter, the input and every leaf module's output multiplied by
    ``1 + u s`` (``s`` = +-1 at random): the float64 image of a computation rounded at unit roundoff ``u``."""
    g = torch.Generator().manual_seed(seed)

    def jitter(t: torch.Tensor) -> torch.Tensor:
        signs = torch.randint(0, 2, t.shape, generator=g, dtype=torch.float64).mul_(2).sub_(1)
        return t * (1 + u * signs)

    saved = {k: p.detach().clone() for k, p in model.named_parameters()}
    hooks = [m.register_forward_hook(lambda m, i, o: jitter(o) if torch.is_tensor(o) else o)
             for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(jitter(p))
            return model(jitter(x))
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(saved[k])


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def reference_forward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The float64 output of ``model`` on ``x`` and the largest magnitude any of its leaf modules output."""
    top = [0.0]
    hooks = [m.register_forward_hook(lambda m, i, o: top.__setitem__(0, max(top[0], float(o.abs().max())))
                                     if torch.is_tensor(o) and o.numel() else None)
             for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            y = model(x)
    finally:
        for h in hooks:
            h.remove()
    return y, top[0]


def out_of_range(y: torch.Tensor, top: float, dtype: torch.dtype) -> str | None:
    """Why the float64 forward (:func:`reference_forward`: output ``y``, largest activation ``top``) cannot be
    represented in ``dtype`` (``None`` if it can):
    a module output beyond the format's largest number (with a margin of 16 for the rounding on the way),
    or logits whose RMS scale ``s`` is below 16 times its smallest normal number ``tiny``. Then the format, not
    the implementation, decides the output. The 16: a logit below ``tiny`` rounds to a subnormal with an
    absolute error of at most ``tiny u`` (half the subnormal spacing ``2 u tiny``), adding at most ``tiny u / s``
    to the output's relative error, where the format's own rounding of the output gives up to ``u``: at
    ``s >= 16 tiny``, 1/16 of it. (It was 1024 times ``tiny``, which left eval mode in float16 unchecked for
    nine of the default suite's models, logits of scale 220 to 830 ``tiny``, whose errors are 0.14 to 0.35
    ``e_u``; MobileNet's logits of 1e-10 stay out, off by 260 ``e_u``.)"""
    info = torch.finfo(dtype)
    scale = float(y.norm()) / math.sqrt(y.numel())
    if top > info.max / 16:
        return f"activations reach {top:.3g}, beyond {info.max / 16:.3g}"
    if scale < info.tiny * 16:
        return f"logits of scale {scale:.3g}, below {info.tiny * 16:.3g}"
    return None


@pytest.mark.parametrize("name", slow_repeats(list_models(task="image"), DEPTH_REPEATS))
def test_half_precision_model_is_within_its_formats_rounding_error_of_float64(name):
    model = calibrated(name)
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    checked = 0
    for train in (False, True):
        model.train(train)
        state = {k: v.clone() for k, v in model.state_dict().items()}  # train mode moves the statistics
        ref, top = reference_forward(model, x)  # (one float64 forward serves both formats' range checks)
        with torch.no_grad():
            for dtype, u in UNIT_ROUNDOFF.items():
                outside = out_of_range(ref, top, dtype)
                model.load_state_dict(state)
                e_u = relative_error(perturbed_output(model, x, u, seed=2), ref)
                model.load_state_dict(state)
                y = model.to(dtype)(x.to(dtype))
                model.double().load_state_dict(state)
                assert y.dtype == dtype and y.shape == ref.shape
                if outside is None:  # every model in every mode stays finite where its values fit the format
                    assert torch.isfinite(y).all(), (name, train, dtype)
                    err = relative_error(y, ref)
                    assert err <= MARGIN * e_u, (name, "train" if train else "eval", dtype, err, e_u)
                    checked += 1
    assert checked, f"{name}: no mode whose values fit float16 or bfloat16"


@pytest.mark.parametrize("name", slow_repeats(list_models(task="image"), DEPTH_REPEATS | DEEP_MODELS))
def test_every_model_runs_in_half_precision_as_initialised(name):
    """``create_model(...).half()`` / ``.to(torch.bfloat16)`` as a user calls it: forward in eval and train
    mode, output in that dtype and finite (the issue's failure was a dtype error in the lambda layers)."""
    model = build_small(name, num_classes=10)
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3))
    for dtype in UNIT_ROUNDOFF:
        half = model.to(dtype)
        for train in (False, True):
            with torch.no_grad():
                y = half.train(train)(x.to(dtype))
            assert y.dtype == dtype and y.shape == (2, 10) and torch.isfinite(y).all(), (name, dtype, train)


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
def test_strided_3d_lambda_layer_runs_in_half_precision_on_the_cpu(dtype):
    """A 3-d lambda layer with ``stride=2`` converted to half precision (torch's ``avg_pool3d`` has no float16 /
    bfloat16 kernel on the CPU; the layer failed with its ``NotImplementedError``): within the same bound as the
    models above of the float64 layer, in eval mode, and its backward in train mode gives finite gradients."""
    from lambdanet import LambdaLayer

    torch.manual_seed(0)
    layer = LambdaLayer(16, 32, dim_k=8, heads=4, r=3, spatial_dims=3, stride=2).double().eval()
    x = torch.randn(2, 16, 5, 6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    with torch.no_grad():
        ref = layer(x)
        e_u = relative_error(perturbed_output(layer, x, UNIT_ROUNDOFF[dtype], seed=2), ref)
        y = layer.to(dtype)(x.to(dtype))
    assert y.dtype == dtype and y.shape == ref.shape == (2, 32, 3, 3, 3)
    assert relative_error(y, ref) <= MARGIN * e_u, (relative_error(y, ref), e_u)
    layer.load_state_dict(state)  # back to the float64 weights, in dtype
    xh = x.to(dtype).requires_grad_()
    layer.train()(xh).float().square().sum().backward()
    assert xh.grad is not None and xh.grad.dtype == dtype and torch.isfinite(xh.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
