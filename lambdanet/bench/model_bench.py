"""Model-level benchmarks: training and inference throughput, peak memory, parameters and FLOPs.

Suites follow the papers' comparisons: ``table13`` (ResNet-50 with lambda layers per stage), ``table14``
(LambdaResNets against ResNet-RS with and without SE), ``halonet`` (H0-H2), ``mobilenet`` (MobileNet-v2
with and without lambda blocks) and ``hybrid26`` (the compact C-C-L-L hybrid against its all-conv twin,
and timm's lambda_resnet26t / resnet26t when timm is installed) and ``timm26`` (our lambda_resnet26t and
halonet26t, timm's architectures on our layers, against timm's own and resnet26t).

Throughput is images per second of a full step (training: forward, backward and an SGD step; inference:
a ``no_grad`` forward in eval mode). Like App. E.2, a batch that does not fit is halved until it does.

:func:`table4_memory` reproduces LambdaNetworks Table 4's memory column from the complexity formulas
evaluated on the actual layer shapes of each ResNet-50 variant, and checks the formulas against the peak
memory measured for single layers at sizes that fit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lambdanet.bench.peers import available_peers
from lambdanet.layers import LambdaLayer
from lambdanet.layers.axial_attention import AxialAttention
from lambdanet.layers.local_attention import LocalSelfAttention
from lambdanet.layers.relative_attention import RelativeSelfAttention
from lambdanet.models import create_model
from lambdanet.runtime import autocast_context, check_amp, count_flops, peak_memory, time_fn

__all__ = [
    "MODEL_SUITES",
    "TABLE4_PAPER_GB",
    "suite_peers",
    "bench_model",
    "run_model_suite",
    "quadratic_bytes",
    "table4_memory",
    "validate_quadratic_memory",
]

_T13 = ("CCCC", "LCCC", "LLCC", "LLLC", "LLLL", "CLLL", "CCLL", "CCCL")
MODEL_SUITES: dict[str, list[tuple[str, str, dict]]] = {
    "table13": [(f"resnet50 {st}", "resnet50", {"stage_layers": st}) for st in _T13],
    "table14": [
        (n, n, {})
        for n in (
            "resnet_rs101",
            "resnet_rs101_se",
            "lambda_resnet101",
            "lambda_resnet101_c4",
            "resnet_rs152",
            "resnet_rs152_se",
            "lambda_resnet152",
            "lambda_resnet152_c4",
        )
    ],
    "halonet": [(n, n, {}) for n in ("halonet_h0", "halonet_h1", "halonet_h2")],
    "mobilenet": [(n, n, {}) for n in ("mobilenet_v2", "mobilenet_v2_lambda")],
    "hybrid26": [
        ("resnet26", "resnet26", {}),
        ("lambda_resnet26", "lambda_resnet26", {}),
        ("timm:resnet26t", "timm:resnet26t", {}),
        ("timm:lambda_resnet26t", "timm:lambda_resnet26t", {}),
    ],
    # the same architectures (and weights) as timm's, side by side with timm's own, relative to resnet26t
    "timm26": [
        ("timm:resnet26t", "timm:resnet26t", {}),
        ("lambda_resnet26t", "lambda_resnet26t", {}),
        ("timm:lambda_resnet26t", "timm:lambda_resnet26t", {}),
        ("halonet26t", "halonet26t", {}),
        ("timm:halonet26t", "timm:halonet26t", {}),
    ],
}


def suite_peers(suites: Sequence[str]) -> tuple[str, ...]:
    """Peer packages (import names) that the models of ``suites`` need: ``("timm",)`` for ``timm:`` entries."""
    return ("timm",) if any(name.startswith("timm:") for s in suites for _, name, _ in MODEL_SUITES[s]) else ()


def _build(name: str, kwargs: dict, img: int) -> nn.Module | None:
    if name.startswith("timm:"):
        if not available_peers(["timm"])["timm"]:
            return None
        import timm

        return timm.create_model(name[5:], pretrained=False)
    return create_model(name, img_size=img, **kwargs)


def _is_oom(err: BaseException) -> bool:
    """An allocation that failed: CUDA's out-of-memory error, or the CPU allocator's ``can't allocate memory``."""
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def bench_model(
    model: nn.Module,
    img: int,
    batch: int,
    *,
    device: str | torch.device = "cpu",
    train: bool = True,
    repeats: int = 3,
    channels_last: bool = False,
    amp: str = "none",
    compile: bool = False,
    min_batch: int = 1,
) -> dict:
    """Images/s of training or inference steps, halving ``batch`` on out-of-memory.

    ``amp`` (``none``, ``bf16``, ``fp16``) runs the forward under ``torch.autocast`` (fp16 training with a
    gradient scaler), ``channels_last`` converts model and input, ``compile`` times ``torch.compile(model)``
    (compilation happens in the warm-up call and is not timed).
    """
    device = torch.device(device)
    check_amp(amp, device)
    model = model.to(device)
    if channels_last:
        _to_channels_last(model)
    runner = torch.compile(model) if compile else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9) if train else None
    scaler = torch.amp.GradScaler(device.type, enabled=train and amp == "fp16")
    while True:

        def step():
            model.train(train)
            if train:
                with autocast_context(device, amp):
                    loss = nn.functional.cross_entropy(runner(x).float(), y)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                with torch.no_grad(), autocast_context(device, amp):
                    runner(x)

        try:  # the batch itself may not fit
            x = torch.randn(batch, 3, img, img, device=device)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            y = torch.randint(0, 1000, (batch,), device=device)
            timing = time_fn(step, device, warmup=2 if compile else 1, repeats=repeats, max_seconds=60)
            peak = peak_memory(step, device)
            break
        except RuntimeError as err:
            if not _is_oom(err) or batch // 2 < min_batch:
                raise
            batch //= 2
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {
        "batch": batch,
        "images_per_s": batch / timing.median_s,
        "step_ms": timing.median_s * 1e3,
        "peak_bytes": peak,
    }


def _to_channels_last(model: nn.Module) -> None:
    """Every 4-d parameter and buffer of ``model`` in channels_last layout, in place. ``model.to(memory_format=)``
    refuses models that also hold 5-d weights (timm's lambda layers: a Conv3d position embedding)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.dim() == 4:
            tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)


def run_model_suite(
    suite: str,
    *,
    img: int = 224,
    batch: int = 16,
    device: str = "cpu",
    repeats: int = 3,
    modes: Sequence[str] = ("train", "infer"),
    channels_last: bool = False,
    amp: str = "none",
    compile: bool = False,
    log=print,
) -> list[dict]:
    """Every model of ``suite``: params, FLOPs (one image), and images/s per mode, relative to the first.
    ``channels_last``, ``amp`` and ``compile`` apply to every model alike (see :func:`bench_model`)."""
    if suite not in MODEL_SUITES:
        raise ValueError(f"unknown model suite {suite!r}; valid: {', '.join(MODEL_SUITES)}")
    rows: list[dict] = []
    for label, name, kwargs in MODEL_SUITES[suite]:
        torch.manual_seed(0)
        model = _build(name, kwargs, img)
        if model is None:
            log(f"  {label}: skipped (timm not installed)")
            continue
        params = sum(p.numel() for p in model.parameters())
        row = {"suite": suite, "model": label, "params": params, "gflops": None, "image_size": img}
        row.update(amp=amp, channels_last=channels_last, compile=compile)
        try:
            with torch.no_grad():
                model.eval()
                x1 = torch.randn(1, 3, img, img)
                row["gflops"] = count_flops(lambda: model(x1)) / 1e9
            for mode in modes:
                res = bench_model(
                    model,
                    img,
                    batch,
                    device=device,
                    train=mode == "train",
                    repeats=repeats,
                    channels_last=channels_last,
                    amp=amp,
                    compile=compile,
                )
                row.update({f"{mode}_{key}": res[key] for key in ("images_per_s", "batch", "peak_bytes")})
        except (RuntimeError, NotImplementedError, ValueError, AssertionError) as err:  # timm's shape asserts
            # a model that cannot run this setting is reported, not fatal: the suite's other models still run (timm's
            # lambda_resnet26t has no channels_last: its 5-d position parameter is rejected by
            # Module.to(memory_format=...); an --img-size too small for a model's strides; batch norm over a
            # single value per channel at --batch-size 1; timm's halonet26t asserts its 8-px blocks divide the size)
            row["error"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:100]}"
            log(f"  {label}: failed ({row['error']})")
        else:
            log(
                f"  {label}: {params / 1e6:.2f}M params, {row['gflops']:.2f} GFLOPs, "
                + ", ".join(f"{m} {row[f'{m}_images_per_s']:.1f} img/s" for m in modes)
            )
        rows.append(row)
    first = next((r for r in rows if "error" not in r), None)  # the ratios' baseline: the first model that ran
    if first is None:
        return rows
    for row in rows:  # (named: without timm, the timm26 suite's first is another)
        row["relative_to"] = first["model"]
        for mode in modes:
            if f"{mode}_images_per_s" in row:
                row[f"{mode}_relative"] = row[f"{mode}_images_per_s"] / first[f"{mode}_images_per_s"]
    return rows


# ------------------------------------------------------------------------------------------------ Table 4

TABLE4_PAPER_GB = {
    "Global self-attention": 120.0,
    "Axial self-attention": 4.8,
    "Lambda layer": 1.9,
    "Lambda layer (|k|=8)": 0.95,
    "Lambda layer (shared embeddings)": 0.63,
}

_TABLE4 = {
    "Global self-attention": ("relative_self_attention", {}, False),
    "Axial self-attention": ("axial_self_attention", {}, False),
    "Local self-attention (7x7)": ("local_self_attention", {}, False),
    "Lambda layer": ("lambda_conv", {"impl": "einsum"}, False),
    "Lambda layer (|k|=8)": ("lambda_conv", {"impl": "einsum", "dim_k": 8}, False),
    "Lambda layer (shared embeddings)": ("lambda_conv", {"impl": "einsum"}, True),
    "Lambda convolution (7x7)": ("lambda_conv", {"r": 7, "impl": "depthwise_conv"}, False),
}


def _layer_sizes(model: nn.Module, img: int) -> list[tuple[nn.Module, tuple[int, int]]]:
    """Every spatial layer with the spatial size of its input, found with forward hooks on the meta device."""
    found = []
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: found.append((mod, tuple(inp[0].shape[2:]))))
        for m in model.modules()
        if isinstance(m, LambdaLayer | RelativeSelfAttention | AxialAttention | LocalSelfAttention)
    ]
    with torch.no_grad():
        model(torch.empty(1, 3, img, img, device="meta"))
    for h in hooks:
        h.remove()
    return found


def quadratic_bytes(layer: nn.Module, size: tuple[int, int], batch: int, shared_seen: set | None = None) -> float:
    """Bytes (fp32) of the tensor Table 4 counts for one layer: ``E`` (``k n m``, once per shared embedding)
    for the lambda layer's einsum form, the attention maps ``b h n m`` (``b h n (H + W)`` axial, ``b h n 49``
    local) for attention. The lambda convolution stores no such tensor (Table 4: "-")."""
    n = size[0] * size[1]
    if isinstance(layer, LambdaLayer):
        if layer.plan(size).position not in ("einsum", "einsum_absolute", "einsum_qe_whole", "einsum_qe_absolute"):
            return 0.0  # no whole E tensor: the lambda convolution or E rows built per query chunk
        if shared_seen is not None:
            key = (id(layer.embedding), size)
            if key in shared_seen:
                return 0.0
            shared_seen.add(key)
        return 4.0 * layer.dim_k * layer.dim_u * layer.groups * n * n
    if isinstance(layer, RelativeSelfAttention):
        return 4.0 * batch * layer.heads * n * n
    if isinstance(layer, AxialAttention):
        return 4.0 * batch * layer.height.heads * n * (size[0] + size[1])
    if isinstance(layer, LocalSelfAttention):
        return 4.0 * batch * layer.attn.heads * n * layer.kernel_size**2
    return 0.0


def table4_memory(batch: int = 128, img: int = 224) -> list[dict]:
    """Table 4's memory column for each ResNet-50 variant from its layer shapes (fp32, batch ``batch``)."""
    rows = []
    for label, (layer, kwargs, shared) in _TABLE4.items():
        with torch.device("meta"):
            model = create_model(
                "resnet50",
                stage_layers="LLLL",
                spatial_layer=layer,
                layer_kwargs=kwargs,
                share_embeddings=shared,
                img_size=img,
            )
        seen: set = set()
        total = sum(quadratic_bytes(m, s, batch, seen) for m, s in _layer_sizes(model, img))
        rows.append(
            {
                "variant": label,
                "ours_gb": total / 1e9,
                "paper_gb": TABLE4_PAPER_GB.get(label),
                "batch": batch,
                "image_size": img,
            }
        )
    return rows


def validate_quadratic_memory(side: int = 28, dim: int = 64, batch: int = 2) -> list[dict]:
    """Measured forward+backward peak of single layers against the formula's quadratic tensor: the
    measured peak must be at least the formula (it also holds activations) and scale like it."""
    rows = []
    for name, layer in (
        ("global attention", RelativeSelfAttention(dim, dim, feat_size=side, heads=4)),
        ("lambda einsum", LambdaLayer(dim, r=23, impl="einsum")),
    ):
        x = torch.randn(batch, dim, side, side, requires_grad=True)
        measured = peak_memory(lambda: layer(x).sum().backward())
        rows.append(
            {
                "layer": name,
                "side": side,
                "batch": batch,
                "measured_bytes": measured,
                "formula_bytes": quadratic_bytes(layer, (side, side), batch),
            }
        )
    return rows
