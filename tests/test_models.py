"""Model zoo: one test per paper-table row (parameter counts) and per registered model (behaviour)."""

import math

import pytest
import torch

from lambdanet.bench import count_flops
from lambdanet.layers import LambdaLayer
from lambdanet.models import Bottleneck, create_model, list_models, model_info
from lambdanet.models.paper_tables import PAPER_ROWS
from lambdanet.models.zoo_resnet import LAMBDA_C4_BLOCKS, RESNET_RS_LAYERS


def meta_params(name, **kwargs):
    with torch.device("meta"):
        model = create_model(name, **kwargs)
    return sum(p.numel() for p in model.parameters())


PARAM_ROWS = [r for r in PAPER_ROWS if r.model and r.params_m is not None]


@pytest.mark.parametrize("row", PARAM_ROWS, ids=[f"T{r.table}:{r.row}" for r in PARAM_ROWS])
def test_paper_table_parameter_count(row):
    params = meta_params(row.model, **row.kwargs) / 1e6
    assert abs(params - row.params_m) <= row.tol * row.params_m, (
        f"{row.call}: {params:.2f}M vs {row.params_m}M (tolerance {row.tol:.1%}) {row.note}")


def test_known_deviations_are_only_the_documented_ones():
    """Rows outside the issue's tolerances (1.5% for Tables 3/9/10/13, 3% otherwise) carry a note."""
    strict = {"3": 0.015, "9": 0.015, "10": 0.015, "13": 0.015}
    for row in PARAM_ROWS:
        base = strict.get(row.table, 0.03)
        if row.tol > base:
            assert row.note, row


def test_resnet50_3x3_convs_hold_11_3m_params():
    """REFERENCE.md: the 3x3 convs of ResNet-50 hold 11.3M parameters."""
    model = create_model("resnet50")
    n = sum(m.conv.weight.numel() for m in model.modules() if type(m).__name__ == "ConvLayer")
    assert abs(n / 1e6 - 11.3) < 0.05


def flops_g(name, size, **kwargs):
    with torch.device("meta"):
        model = create_model(name, **kwargs).eval()
        x = torch.empty(1, 3, size, size)
        return count_flops(lambda: model(x)) / 1e9


def test_flops_where_the_counting_convention_is_unambiguous():
    assert abs(flops_g("mobilenet_v2", 224) - 0.603) / 0.603 < 0.01  # Table 17: 603 MFLOPs
    assert abs(flops_g("resnet50", 224) - 8.2) / 8.2 < 0.01  # 4.1 G multiply-adds
    content_only = flops_g("resnet50", 224, stage_layers="LLLL", layer_kwargs={"position": False})
    assert abs(content_only - 5.0) / 5.0 < 0.015  # Table 10, content-only lambda ResNet-50


@pytest.mark.parametrize("depth", sorted(RESNET_RS_LAYERS))
def test_lambda_resnet_block_placement_follows_table_18(depth):
    model = create_model(f"lambda_resnet{depth}")
    layers = RESNET_RS_LAYERS[depth]
    for stage, n in zip(model.stages, layers):
        assert len(stage) == n
    kinds = [[isinstance(b.spatial, LambdaLayer) for b in stage] for stage in model.stages]
    assert not any(kinds[0]) and not any(kinds[1])
    assert [j + 1 for j, is_l in enumerate(kinds[2]) if is_l] == list(LAMBDA_C4_BLOCKS[depth])
    assert all(kinds[3])
    c4 = [b.spatial for b in model.stages[2] if isinstance(b.spatial, LambdaLayer)]
    c5 = [b.spatial for b in model.stages[3]]
    assert {(m.dim_u, m.r) for m in c4} == {(1, 23)} and {(m.dim_u, m.r) for m in c5} == {(4, 7)}
    assert not any(isinstance(m, torch.nn.Module) and type(m).__name__ == "SqueezeExcite" for m in model.modules())


def test_resnet_rs_stem_and_shortcut_are_resnet_d():
    model = create_model("resnet_rs50")
    convs = [m for m in model.stem if isinstance(m, torch.nn.Conv2d)]
    assert [(c.kernel_size, c.stride, c.out_channels) for c in convs] == [
        ((3, 3), (2, 2), 32), ((3, 3), (1, 1), 32), ((3, 3), (1, 1), 64), ((3, 3), (2, 2), 64)]
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.stem)  # max pool replaced by a strided conv
    short = model.stages[1][0].shortcut
    assert isinstance(short[0], torch.nn.AvgPool2d) and short[1].stride == (1, 1)


@pytest.mark.parametrize("name", list_models())
def test_every_model_trains_a_step(name):
    """Forward and backward at a small size, no NaN, every parameter gets a (non-zero) gradient."""
    model = create_model(name, num_classes=7, zero_init_last=False) if "mobilenet" not in name else \
        create_model(name, num_classes=7)
    x = torch.randn(2, 3, 64, 64)
    y = model(x)
    assert y.shape == (2, 7) and torch.isfinite(y).all()
    torch.nn.functional.cross_entropy(y, torch.tensor([1, 3])).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
               or p.grad.abs().sum() == 0]
    assert not missing, missing


@pytest.mark.parametrize("name", list_models())
def test_every_model_converts_to_channels_last(name):
    """``model.to(memory_format=torch.channels_last)`` (the timm / torchvision idiom) works and changes
    nothing but the layout. Checked module by module: each layer of the converted model, given the
    channels_last copy of the input its NCHW twin saw, returns the same output (float64). End to end the
    comparison would be meaningless: a deep random network in training-mode BN at batch 2 turns a 1e-13
    input perturbation into a 1e-4 output change (HaloNet-H4)."""
    torch.manual_seed(0)
    kwargs = {"drop_rate": 0.0} | ({} if "mobilenet" in name else {"zero_init_last": False})
    model = create_model(name, num_classes=5, **kwargs).double()
    checked = {n: m for n, m in model.named_modules()
               if n and (not list(m.children()) or type(m).__module__.startswith("lambdanet.layers"))}
    seen: dict[str, list] = {}

    def record_input(name):  # a copy before the call: in-place modules (ReLU) overwrite their input
        def hook(module, inputs):
            if name not in seen:
                seen[name] = [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)]
        return hook

    def record_output(name):
        def hook(module, inputs, output):
            if name in seen and len(seen[name]) == 1:  # first call of a reused module
                seen[name].append(output.clone() if isinstance(output, torch.Tensor) else None)
        return hook

    hooks = [h for n, m in checked.items()
             for h in (m.register_forward_pre_hook(record_input(n)), m.register_forward_hook(record_output(n)))]
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        model(x)
        for h in hooks:
            h.remove()
        model.to(memory_format=torch.channels_last)
        convs = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)]
        assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
        assert torch.isfinite(model(x.contiguous(memory_format=torch.channels_last))).all()
        spatial = 0
        for n, (inputs, ref) in seen.items():
            if not isinstance(ref, torch.Tensor):
                continue
            inputs = [t.contiguous(memory_format=torch.channels_last) if isinstance(t, torch.Tensor) and t.dim() == 4
                      else t for t in inputs]
            spatial += ref.dim() == 4
            torch.testing.assert_close(checked[n](*inputs), ref, rtol=1e-9, atol=1e-9, msg=lambda m, n=n: f"{n}: {m}")
    assert spatial > 10


@pytest.mark.parametrize("name", list_models())
def test_every_model_features_and_classifier(name):
    info = model_info(name)
    assert info.input_size > 0 and info.paper
    with torch.device("meta"):
        feats_model = create_model(name, features_only=True)
        x = torch.empty(1, 3, 128, 96)
        feats = feats_model(x)
        assert len(feats) == 4 == len(feats_model.feature_info)
        for f, fi, stride in zip(feats, feats_model.feature_info, (4, 8, 16, 32)):
            assert fi["reduction"] == stride
            assert f.shape == (1, fi["num_chs"], math.ceil(128 / stride), math.ceil(96 / stride))
        model = create_model(name, num_classes=0, in_chans=1)
        pooled = model(torch.empty(2, 1, 64, 64))
        assert pooled.shape == (2, model.num_features)
        model.reset_classifier(5)
        assert model(torch.empty(2, 1, 64, 64)).shape == (2, 5)


def test_zero_init_last_makes_every_block_start_as_identity_branch():
    model = create_model("lambda_resnet26").eval()
    for block in (m for m in model.modules() if isinstance(m, Bottleneck)):
        x = torch.randn(1, block.conv1.in_channels, 8, 8)
        assert torch.equal(block(x), block.act(block.shortcut(x)))


def test_stochastic_depth_and_dropout_are_active_only_in_training():
    model = create_model("resnet26", num_classes=5, drop_path_rate=0.5, drop_rate=0.5, zero_init_last=False,
                         base_width=8)
    x = torch.randn(4, 3, 32, 32)
    model.train()
    assert not torch.allclose(model(x), model(x))
    model.eval()
    torch.testing.assert_close(model(x), model(x))
    rates = [b.drop_path.p for b in model.modules() if isinstance(b, Bottleneck) and hasattr(b.drop_path, "p")]
    assert rates[-1] == pytest.approx(0.5) and rates == sorted(rates)  # linear in depth


def test_cifar_stem_keeps_resolution_and_global_layers_use_img_size():
    model = create_model("resnet26", stem="cifar", stage_layers="CCLL", spatial_layer="lambda", img_size=32,
                         base_width=16, num_classes=10)
    assert model.feature_info[0]["reduction"] == 1
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    lam = [m for m in model.modules() if isinstance(m, LambdaLayer)]
    # a strided block computes its lambdas at its input resolution, then pools (App. E.1)
    assert [m.feat_size for m in lam] == [(16, 16), (8, 8), (8, 8), (4, 4)]
    with pytest.raises(ValueError, match="larger than feat_size"):
        model(torch.randn(2, 3, 40, 40))


def test_every_table_3_and_4_row_is_one_create_model_call():
    for row in [r for r in PAPER_ROWS if r.table in ("3", "4") and r.model]:
        with torch.device("meta"):
            model = create_model(row.model, **row.kwargs)
            assert model(torch.empty(1, 3, 224, 224)).shape == (1, 1000), row.row


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda: create_model("resnet51"), "unknown model 'resnet51'; registered models: halonet_h0"),
        (lambda: create_model("resnet50", stage_layers="CCXL"), "stage_layers must be 4 letters"),
        (lambda: create_model("resnet50", stage_layers="CCLL", spatial_layer="magic"), "spatial_layer must be one of"),
        (lambda: create_model("resnet50", spatial_layer="halo_attention"), "also pass stage_layers"),
        (lambda: create_model("resnet50", depth=3), "does not take ['depth']; it accepts: stage_layers"),
        (lambda: create_model("resnet50", num_classes=-1), "num_classes must be a non-negative int"),
        (lambda: create_model("resnet50", drop_path_rate=1.5), "drop_path_rate must be in [0, 1)"),
        (lambda: create_model("resnet50", nonlocal_blocks={"c9": (1,)}), "nonlocal_blocks keys"),
        (lambda: create_model("resnet50", stage_layers="LLLL", layer_kwargs={"heads": 5}), "heads=5 must divide"),
        (lambda: create_model("resnet50", share_embeddings=True, stage_layers="LLLL",
                              spatial_layer="halo_attention"), "share_embeddings needs lambda layers"),
        (lambda: create_model("mobilenet_v2_lambda", lambda_blocks=(18,)), "lambda_blocks must be 1-indexed"),
    ],
)
def test_bad_model_arguments_raise_value_error_listing_choices(call, needle):
    with pytest.raises(ValueError) as err:
        call()
    assert needle in str(err.value)


def test_list_models_pattern():
    assert list_models("lambda_resnet*_c4") == ["lambda_resnet101_c4", "lambda_resnet152_c4", "lambda_resnet200_c4",
                                                "lambda_resnet270_c4"]
    assert {"resnet50", "resnet_rs420_se", "halonet_h7", "mobilenet_v2_lambda", "lambda_resnet26"} <= set(
        list_models())
