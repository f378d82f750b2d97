"""Model zoo: one test per paper-table row (parameter counts) and per registered model (behaviour).

Parameter counts, block placement and shapes are checked on the meta device (no allocation, so the
420-layer models cost no more than ResNet-26); forward and backward passes run on the models registered as
``small`` and the MobileNets at full width, on the other ResNets and HaloNets at 1/8 of their width (base
width 8: the same blocks, layers and placement).
"""

import dataclasses
import functools
import inspect
import math
import re

import pytest
import torch

from lambdanet.layers import LambdaLayer
from lambdanet.models import Bottleneck, ResNet, ResNetArgs, create_model, list_models, model_args, model_info
from lambdanet.models import byoa, halonet, mobilenet, zoo_resnet
from lambdanet.models.registry import published_models
from lambdanet.models.halonet import halonet_config
from lambdanet.models.paper_tables import PAPER_ROWS
from lambdanet.models.resnet import ResNetConfig, build_resnet
from lambdanet.models.registry import register_model
from lambdanet.models.zoo_resnet import LAMBDA_C4_BLOCKS, RESNET_RS_LAYERS, TABLE20_REGULARIZATION, Table20Row
from lambdanet.runtime import count_flops
from lambdanet.tasks.classification.config import TrainConfig

FAMILIES = (zoo_resnet, halonet, mobilenet, byoa)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_params(name, **kwargs):
    with torch.device("meta"):
        return n_params(create_model(name, **kwargs))


@functools.cache
def row_params_m(i: int) -> float:
    """Our parameter count (M) for ``PAPER_ROWS[i]``, computed once for the tests that share it."""
    return meta_params(PAPER_ROWS[i].model, **PAPER_ROWS[i].kwargs) / 1e6


def narrowing(name: str) -> int:
    """By how much :func:`build_small` divides the widths of ``name``: 1 for the models registered as
    ``small``, the MobileNets (3.5M parameters, no width option) and timm's architectures (11-23M parameters,
    fixed to their checkpoints), 8 for the other ResNets and HaloNets."""
    return 1 if model_info(name).small or name in mobilenet.model_cfgs or name in byoa.model_cfgs else 8


def build_small(name: str, **kwargs) -> torch.nn.Module:
    """``create_model(name, **kwargs)`` made fast on a CPU: the widths divided by :func:`narrowing` (base
    width 8 instead of 64: the same blocks, layers and placement)."""
    if narrowing(name) == 1:
        return create_model(name, **kwargs)
    if name in halonet.model_cfgs:  # HaloNets take no width option: the same Table A2 row at base width 8
        num_classes = kwargs.pop("num_classes", 1000)
        return build_resnet(halonet_config(name, base_width=8), ResNetArgs(**kwargs), num_classes=num_classes)
    return create_model(name, base_width=8, **kwargs)


# timm's architectures run at full width (3-11 s each in the float64 tests): the default suite keeps one per
# block kind not covered elsewhere (local lambda with timm's conventions, halo with ECA and groups, RegNetZ
# with SE and a pooled halo); the global lambda and BoTNet layers are the paper zoo's, and the others repeat
# those blocks in deeper trunks: they run with -m slow
BYOA_REPEATS = {"lambda_resnet50ts", "halonet26t", "sehalonet33ts", "halonet50ts", "sebotnet33ts_256",
                "lamhalobotnet50ts_256", "halo2botnet50ts_256", "lambda_resnet26rpt_256", "botnet26t_256"}


# The paper zoo's deeper trunks: the blocks and lambda kwargs of a shallower registered model of their family, more
# of them (ResNet-RS 101-420 as resnet_rs50 / _se; LambdaResNet 101-420 as lambda_resnet50, whose c4 mixes conv and
# lambda blocks too; lambda_resnet152_c4 as 101_c4; resnet101 / 152 as resnet50), and the HaloNets whose block size
# and halo another keeps, at other widths and depths (h1, h2 as h0: b 8, halo 3; h7 as h3: b 10, halo 3; h5 as h4:
# halo 2, a block size that does not divide the maps). The sweeps over the zoo (features, channels last, a training
# step, the small variants, half precision) run them with -m slow (2-14 s each, nothing their shallower model does
# not test); the parameter counts of Tables 3, 4, 9-14 still build every model
DEPTH_REPEATS = {*(f"resnet_rs{d}{se}" for d in (101, 152, 200, 270, 350, 420) for se in ("", "_se")),
                 *(f"lambda_resnet{d}" for d in (101, 152, 200, 270, 350, 420)), "lambda_resnet152_c4",
                 "resnet101", "resnet152", "halonet_h1", "halonet_h2", "halonet_h5", "halonet_h7"}  # fmt: skip


# the 270- to 420-layer variants repeat the blocks of the shallower ones and take 5-9 s each to build even on the
# meta device: they run with -m slow
DEEP_MODELS = {n for n in list_models(task="image") if re.search(r"(270|350|420)", n)}


def slow_repeats(names, repeats=frozenset()):
    """``names`` as pytest parameters, those of :data:`BYOA_REPEATS` and of ``repeats`` marked slow."""
    slow = BYOA_REPEATS | repeats
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in names]


PARAM_ROWS = [i for i, r in enumerate(PAPER_ROWS) if r.model and r.params_m is not None]
PARAM_IDS = [f"T{PAPER_ROWS[i].table}:{PAPER_ROWS[i].row}" for i in PARAM_ROWS]
# the tolerances of the issue: 1.5% for LambdaNetworks Tables 3, 9, 10 and 13, 3% for the others
DEFAULT_TOL = {"3": 0.015, "9": 0.015, "10": 0.015, "13": 0.015}
# "ours 15.03M (+1.6%)": the figure a note quotes for our implementation
OURS = re.compile(r"ours (\d+\.\d+)M \(([+-]\d+\.\d)%\)")


@pytest.mark.parametrize("i", PARAM_ROWS, ids=PARAM_IDS)
def test_paper_table_parameter_count(i):
    row, params = PAPER_ROWS[i], row_params_m(i)
    assert abs(params - row.params_m) <= row.tol * row.params_m, (
        f"{row.call}: {params:.2f}M vs {row.params_m}M (tolerance {row.tol:.1%}) {row.note}")


@pytest.mark.parametrize("i", PARAM_ROWS, ids=PARAM_IDS)
def test_tolerance_is_widened_exactly_for_the_rows_that_deviate_and_their_notes_quote_our_count(i):
    """A row gets a tolerance above the table's default exactly when our count is outside the default; its
    note then quotes our count ("ours 11.82M (-3.9%)"), and every count a note quotes is what we compute."""
    row, params = PAPER_ROWS[i], row_params_m(i)
    delta = params / row.params_m - 1
    base = DEFAULT_TOL.get(row.table, 0.03)
    assert (abs(delta) > base) == (row.tol > base), (row.call, f"{delta:+.2%}", row.tol)
    quoted = OURS.findall(row.note)
    if row.tol > base:
        assert quoted, f"{row.call}: a widened tolerance needs a note quoting our count"
    for figure, percent in quoted:
        assert float(figure) == pytest.approx(round(params, 2), abs=1e-9), (row.call, figure, params)
        assert float(percent) == pytest.approx(round(100 * delta, 1), abs=1e-9), (row.call, percent, delta)


def test_halonet_h3_alternatives_stated_in_the_docs():
    """docs/models.md and the H3 row's note: with the row's values H3 has 11.82M parameters against the
    paper's 12.3M; one entry changed at a time, ``df = 1280`` (H4's value) gives 12.27M and ``l3 = 13``
    12.21M (68 layers where the row says 65), while ``rb``, ``rv`` and ``df = 1536`` overshoot."""
    note = next(r.note for r in PAPER_ROWS if r.model == "halonet_h3")
    stated = re.findall(r"(df|l3|rb|rv) = (\d+(?:\.\d+)?)[^:,;]*: (\d+\.\d+)M", note)
    assert {sym for sym, _, _ in stated} == {"df", "l3", "rb", "rv"}, note
    for sym, value, figure in stated:
        with torch.device("meta"):
            cfg = halonet_config("halonet_h3", **{sym: int(value) if sym in ("df", "l3") else float(value)})
            params = n_params(ResNet(cfg))
        assert round(params / 1e6, 2) == float(figure), (sym, value, params)
    spec = halonet.model_cfgs["halonet_h3"]
    assert 3 * (3 + 3 + spec.l3 + 3) + 2 == 65  # Table A2's layer count: stem, 3 convs per block, classifier


def test_resnet50_3x3_convs_hold_11_3m_params():
    """REFERENCE.md: the 3x3 convs of ResNet-50 hold 11.3M parameters."""
    with torch.device("meta"):
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
    with torch.device("meta"):
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
    with torch.device("meta"):
        model = create_model("resnet_rs50")
    convs = [m for m in model.stem if isinstance(m, torch.nn.Conv2d)]
    assert [(c.kernel_size, c.stride, c.out_channels) for c in convs] == [
        ((3, 3), (2, 2), 32), ((3, 3), (1, 1), 32), ((3, 3), (1, 1), 64), ((3, 3), (2, 2), 64)]
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.stem)  # max pool replaced by a strided conv
    short = model.stages[1][0].shortcut
    assert isinstance(short[0], torch.nn.AvgPool2d) and short[1].stride == (1, 1)


@pytest.mark.parametrize("name", slow_repeats(list_models(task="image"), DEPTH_REPEATS | DEEP_MODELS))
def test_small_variants_keep_the_architecture_but_not_the_width(name):
    """The fast variant of the behaviour tests keeps every block, layer type and placement of the registered
    model and divides its stage widths by :func:`narrowing`. (Only a shortcut may differ: the stem keeps its
    64 channels, so a block whose output was 64 wide gets a 1x1 projection at the narrow width.)"""
    with torch.device("meta"):
        full, small = create_model(name), build_small(name)
    assert [type(m) for n, m in full.named_modules() if "shortcut" not in n] == [
        type(m) for n, m in small.named_modules() if "shortcut" not in n]
    assert [f["num_chs"] // narrowing(name) for f in full.feature_info] == [f["num_chs"] for f in small.feature_info]


@pytest.mark.parametrize("name", slow_repeats(list_models(task="image"), DEPTH_REPEATS | DEEP_MODELS))
def test_every_model_trains_a_step(name):
    """Forward and backward at a small size, no NaN, every parameter gets a (non-zero) gradient."""
    torch.manual_seed(0)
    model = build_small(name, num_classes=7, **({} if "mobilenet" in name else {"zero_init_last": False}))
    x = torch.randn(2, 3, 64, 64)
    y = model(x)
    assert y.shape == (2, 7) and torch.isfinite(y).all()
    torch.nn.functional.cross_entropy(y, torch.tensor([1, 3])).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
               or p.grad.abs().sum() == 0]
    assert not missing, missing


@pytest.mark.parametrize("name", slow_repeats(list_models(task="image"), DEPTH_REPEATS | DEEP_MODELS))
def test_every_model_converts_to_channels_last(name):
    """``model.to(memory_format=torch.channels_last)`` (the timm / torchvision idiom) works and changes
    nothing but the layout. Checked module by module: each layer of the converted model, given the
    channels_last copy of the input its NCHW twin saw, returns the same output (float64). End to end the
    comparison would be meaningless: a deep random network in training-mode BN at batch 2 turns a 1e-13
    input perturbation into a 1e-4 output change (HaloNet-H4)."""
    torch.manual_seed(0)
    kwargs = {"drop_rate": 0.0} | ({} if "mobilenet" in name else {"zero_init_last": False})
    model = build_small(name, num_classes=5, **kwargs).double()
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


@pytest.mark.parametrize("name", slow_repeats(list_models(task="image"), DEPTH_REPEATS | DEEP_MODELS))
def test_every_model_features_and_classifier(name):
    info = model_info(name)
    assert info.input_size > 0 and info.paper
    with torch.device("meta"):  # eval mode: the shapes alike, half the time (training BN decomposes on meta)
        feats_model = create_model(name, features_only=True).eval()
        x = torch.empty(1, 3, 128, 96)
        feats = feats_model(x)
        assert len(feats) == 4 == len(feats_model.feature_info)
        for f, fi, stride in zip(feats, feats_model.feature_info, (4, 8, 16, 32)):
            assert fi["reduction"] == stride
            assert f.shape == (1, fi["num_chs"], math.ceil(128 / stride), math.ceil(96 / stride))
        model = create_model(name, num_classes=0, in_chans=1).eval()
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
        (lambda: create_model("resnet51"), "unknown model 'resnet51'; did you mean resnet50"),
        (lambda: create_model("resnet50", stage_layers="CCXL"), "stage_layers must be 4 letters"),
        (lambda: create_model("resnet50", stage_layers="CCLL", spatial_layer="magic"), "spatial_layer must be one of"),
        (lambda: create_model("resnet50", spatial_layer="halo_attention"), "also pass stage_layers"),
        (lambda: create_model("resnet50", depth=3), "does not take ['depth']; it accepts: stage_layers"),
        (lambda: create_model("resnet50", num_classes=-1), "num_classes must be a non-negative int"),
        (lambda: create_model("resnet26", num_classes=True), "num_classes must be a non-negative int, got True"),
        (lambda: create_model("resnet26", in_chans=False), "in_chans must be a positive int, got False"),
        (lambda: create_model("resnet26", stage_layers="CCLL", layer_kwargs=7), "layer_kwargs must be a mapping"),
        (lambda: create_model("resnet50", drop_path_rate=1.5), "drop_path_rate must be in [0, 1)"),
        (lambda: create_model("resnet50", nonlocal_blocks={"c9": (1,)}), "nonlocal_blocks keys"),
        (lambda: create_model("resnet50", stage_layers="LLLL", layer_kwargs={"heads": 5}), "heads=5 must divide"),
        (lambda: create_model("resnet50", share_embeddings=True, stage_layers="LLLL",
                              spatial_layer="halo_attention"), "share_embeddings needs lambda layers"),
        (lambda: create_model("mobilenet_v2_lambda", lambda_blocks=(18,)), "lambda_blocks must be 1-indexed"),
        (lambda: create_model("halonet_h0", stem="cifar"), "does not take ['stem']; it accepts: img_size"),
        (lambda: create_model("mobilenet_v2", lambda_blocks=(10,)), "does not take ['lambda_blocks']"),
        (lambda: build_resnet(ResNetConfig(layers=(1, 1, 1, 1), act=None), ResNetArgs()), "act must be one of"),
        (lambda: create_model("lambda_resnet26", se="bogus"), "se must be True, False or a reduction ratio in (0, 1]"),
        (lambda: create_model("resnet26", se=16), "se must be True, False or a reduction ratio in (0, 1], got 16"),
        (lambda: list_models(task="bogus"), "task must be one of ['image', 'lm'], got 'bogus'"),
        (lambda: list_models(3), "pattern must be a shell-style wildcard string or None, got 3"),
        (lambda: list_models(["lambda*", 3]), "wildcard string or None, got ['lambda*', 3] (or a list of them"),
        # options of the L layers on a model without any were accepted and ignored (a plain ResNet-50 came back)
        (lambda: create_model("resnet50", layer_kwargs={"dim_k": 8}), "layer_kwargs configures the spatial layers"),
        (lambda: create_model("resnet50", layer_kwargs={"typo": 1}), "this model has none (all blocks are conv"),
        (lambda: create_model("resnet26", share_embeddings=True), "share_embeddings configures the spatial layers"),
        # wrong types: one line naming the argument (were TypeErrors from a comparison or an iteration)
        (lambda: create_model("resnet26", drop_rate="0.1"), "drop_rate must be a finite number in [0, 1), got '0.1'"),
        (lambda: create_model("resnet26", drop_path_rate=None),
         "drop_path_rate must be a finite number in [0, 1), got None"),
        (lambda: create_model("botnet26t_256", drop_path_rate="x"), "drop_path_rate must be a finite number in [0, 1)"),
        (lambda: create_model("resnet26", nonlocal_blocks={"c3": 1}), "nonlocal_blocks['c3'] must be 1-indexed blocks"),
        (lambda: create_model("resnet26", nonlocal_blocks=[1]), "nonlocal_blocks must be a mapping {stage: (block"),
        (lambda: create_model("mobilenet_v2_lambda", lambda_blocks=3), "lambda_blocks must be 1-indexed inverted"),
        (lambda: create_model("mobilenet_v2", img_size=-5), "img_size must be a positive int or (H, W), got -5"),
        (lambda: create_model("mobilenet_v2", img_size=(160, 0)), "img_size must be a positive int or (H, W)"),
        (lambda: create_model("botnet26t_256", img_size=(256,)), "img_size must be a positive int or (H, W)"),
        (lambda: list_models(pretrained="yes"), "pretrained must be True or False, got 'yes'"),
        (lambda: register_model(3), "register_model expects a model function (its name is the model's), got 3"),
    ],
)
def test_bad_model_arguments_raise_value_error_listing_choices(call, needle):
    with pytest.raises(ValueError) as err:
        call()
    assert needle in str(err.value)


def test_list_models_takes_timms_filters():
    """timm's ``list_models(["a*", "b*"])`` (any of the wildcards) and ``list_models(pretrained=True)`` (the names
    with published weights, as ``published_models`` lists them)."""
    both = list_models(["lambda_resnet26*", "botnet*"])
    assert both == sorted(set(list_models("lambda_resnet26*")) | set(list_models("botnet*"))) and len(both) == 4
    assert list_models([]) == list_models()  # as timm: no filter
    published = list_models(pretrained=True)
    assert published == sorted(published_models()) and "botnet26t_256" in published and "resnet50" not in published
    assert list_models("*halo*", pretrained=True) == [n for n in published if "halo" in n]


def test_mobilenet_and_the_timm_architectures_record_the_size_they_are_built_for():
    """``pretrained_cfg["input_size"]`` (what ``predict`` and timm's data helpers resize to) is the model's checked
    ``(H, W)``; a MobileNet kept ``img_size=(160, 192)`` as ``((160, 192), (160, 192))``."""
    assert create_model("mobilenet_v2", img_size=(160, 192)).pretrained_cfg["input_size"] == (3, 160, 192)
    assert create_model("mobilenet_v2", img_size=None).img_size == (224, 224)  # the default, not (None, None)
    model = create_model("botnet26t_256", img_size=(64, 96), num_classes=3).eval()
    assert model.pretrained_cfg["input_size"] == (3, 64, 96) and model.img_size == (64, 96)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 96)).shape == (1, 3)


def test_a_registered_models_pretrained_cfg_names_its_own_classifier():
    """timm's tools look the classifier up by ``pretrained_cfg["classifier"]``: it was ``"fc"`` for every model,
    also a registered one without such a module."""
    from lambdanet.models.registry import unregister_model

    @register_model
    def test_tmp_sequential(*, num_classes=10, in_chans=3, width=4):
        return torch.nn.Sequential(torch.nn.Conv2d(in_chans, width, 3), torch.nn.AdaptiveAvgPool2d(1),
                                   torch.nn.Flatten(), torch.nn.Linear(width, num_classes))  # fmt: skip

    try:
        model = create_model("test_tmp_sequential")
        assert model.pretrained_cfg["classifier"] == "3" and model.pretrained_cfg["first_conv"] == "0"
        assert dict(model.named_modules())["3"] is model[3]
    finally:
        unregister_model("test_tmp_sequential")
    assert create_model("resnet26").pretrained_cfg["classifier"] == "fc"


def test_list_models_pattern():
    assert list_models("lambda_resnet*_c4") == ["lambda_resnet101_c4", "lambda_resnet152_c4", "lambda_resnet200_c4",
                                                "lambda_resnet270_c4"]
    assert {"resnet50", "resnet_rs420_se", "halonet_h7", "mobilenet_v2_lambda", "lambda_resnet26"} <= set(
        list_models(task="image"))


def test_model_args_of_lambda_resnet26():
    args = model_args("lambda_resnet26")
    assert args | {"stage_layers": None, "stem": None, "base_width": None, "img_size": None, "drop_rate": 0.0,
                   "drop_path_rate": 0.0, "features_only": False, "zero_init_last": True} == args
    assert "num_classes" not in args and "in_chans" not in args
    args["stem"] = "cifar"  # a copy: the registry's declaration is unchanged
    assert model_args("lambda_resnet26")["stem"] is None
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        model_args("nope")


# one model per distinct declaration of keyword arguments (the families declare them once)
ARGS_EXAMPLES = ["lambda_resnet26", "halonet_h0", "mobilenet_v2", "mobilenet_v2_lambda", "lambda_resnet26t"]


def test_args_examples_cover_every_declaration():
    assert {repr(model_args(n)) for n in list_models(task="image")} == {repr(model_args(n)) for n in ARGS_EXAMPLES}


@pytest.mark.parametrize("name", ARGS_EXAMPLES)
def test_model_args_are_the_defaults_create_model_uses(name):
    """Passing every declared keyword at its declared default builds the same module as passing none."""
    with torch.device("meta"):
        assert repr(create_model(name, **model_args(name))) == repr(create_model(name))


def test_every_registered_name_is_a_literal_entry_point_and_table_entry():
    """A search for a model's name lands on its definition: one ``model_cfgs`` entry in exactly one family
    and a module-level entry point ``def <name>(`` that builds that entry."""
    for name in list_models(task="image"):
        owners = [f for f in FAMILIES if name in f.model_cfgs]
        assert len(owners) == 1, (name, owners)
        fn = getattr(owners[0], name)
        source = inspect.getsource(fn)
        assert f"def {name}(" in source and f'"{name}"' in source, source
    assert sorted(n for f in FAMILIES for n in f.model_cfgs) == list_models(task="image")


def test_recipe_keys_are_train_config_fields_with_valid_values():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    pending = {"nesterov", "lr_decay_rate", "lr_decay_epochs"} - fields  # TrainConfig fields being added
    for name in list_models(task="image"):
        recipe = {k: v for k, v in model_info(name).recipe.items() if k not in pending}
        if pending and recipe.get("schedule") == "step":
            recipe.pop("schedule")
        assert set(recipe) <= fields, (name, sorted(set(recipe) - fields))
        TrainConfig(**recipe, model=name).validate()  # valid choices and ranges
        assert not recipe or model_info(name).recipe_source, name


def test_paper_recipes():
    """App. E.2 (MobileNet: RMSProp, x0.99 every 3 epochs, dropout 0.2 at 224), HaloNet Sec. 4.1 (Nesterov)
    and Tables 19-20 (LambdaResNet-50 trained at 160 with magnitude 10, dropout 0.2)."""
    mobile = model_info("mobilenet_v2").recipe
    assert {k: mobile[k] for k in ("optimizer", "schedule", "lr_decay_rate", "lr_decay_epochs", "drop_rate",
                                   "img_size")} == {"optimizer": "rmsprop", "schedule": "step", "lr_decay_rate": 0.99,
                                                    "lr_decay_epochs": 3.0, "drop_rate": 0.2, "img_size": 224}
    halo = model_info("halonet_h5").recipe
    assert (halo["optimizer"], halo["nesterov"], halo["img_size"], halo["randaugment_magnitude"]) == ("sgd", True,
                                                                                                     448, 19)
    info = model_info("lambda_resnet50")
    assert info.input_size == 160
    assert {k: info.recipe[k] for k in ("img_size", "randaugment_magnitude", "drop_rate", "drop_path_rate")} == {
        "img_size": 160, "randaugment_magnitude": 10, "drop_rate": 0.2, "drop_path_rate": 0.0}


# ResNet-RS and LambdaResNets: the 350-epoch recipes of Tables 19-20 (lambda_resnet26 is not in the paper)
TABLE20_MODELS = [n for n in list_models(task="image") if n.startswith(("resnet_rs", "lambda_resnet"))
                  and n != "lambda_resnet26" and n not in byoa.model_cfgs]


@pytest.mark.parametrize("name", TABLE20_MODELS)
def test_table20_recipes_are_table_rows_at_the_model_input_size(name):
    """Every ResNet-RS / LambdaResNet recipe is a Table 20 row, the row at the model's input size where
    Table 20 lists that size for the depth, else the largest listed size below it."""
    info = model_info(name)
    depth = int(re.search(r"(\d+)", name.removeprefix("resnet_rs").removeprefix("lambda_resnet")).group(1))
    row = Table20Row(*(info.recipe[k] for k in Table20Row._fields))
    listed = TABLE20_REGULARIZATION.get(depth)
    if listed is None:
        assert "nearest depth" in info.recipe_source, name
        listed = TABLE20_REGULARIZATION[min(TABLE20_REGULARIZATION, key=lambda d: abs(d - depth))]
    assert row in listed, (name, row)
    sizes = [r.img_size for r in listed]
    assert row.img_size == (info.input_size if info.input_size in sizes else max(s for s in sizes
                                                                                 if s < info.input_size))
