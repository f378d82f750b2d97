"""timm's model interface on our image models: ``pretrained_cfg`` in timm's keys, read by timm's own data helpers,
and the classifier / feature methods timm's tools call.

The expectations are timm's: ``timm.data.resolve_data_config`` and ``create_transform`` on our model against the
same on timm's own model of that name (its ``pretrained_cfg`` is timm's published preprocessing), and the
identities the methods must satisfy (``forward == forward_head(forward_features)``, a reset classifier's shape,
the modules ``first_conv`` / ``classifier`` name).
"""

import pytest
import torch

from lambdanet.models import byoa, create_model, list_models, model_info

timm = pytest.importorskip("timm")
from timm.data import create_transform, resolve_data_config, resolve_model_data_config  # noqa: E402

TIMM_NAMES = sorted(byoa.model_cfgs)


def _normalised(cfg: dict) -> dict:
    return {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in cfg.items()}


@pytest.mark.parametrize("name", TIMM_NAMES)
def test_timm_data_helpers_configure_our_model_as_timms_own(name):
    with torch.device("meta"):
        ours, theirs = create_model(name), timm.create_model(name)
    got, want = resolve_data_config(model=ours), resolve_data_config(model=theirs)
    assert _normalised(got) == _normalised(want)
    assert _normalised(resolve_model_data_config(ours)) == _normalised(resolve_model_data_config(theirs))
    for training in (False, True):
        assert repr(create_transform(**got, is_training=training)) == repr(create_transform(**want,
                                                                                           is_training=training))


def test_the_size_timm_helpers_give_is_the_models_not_timms_default():
    """The issue's example: timm's helpers read 256 px and crop 0.94 from lambda_resnet26t, not 224 / 0.875."""
    with torch.device("meta"):
        cfg = resolve_data_config(model=create_model("lambda_resnet26t"))
    assert cfg["input_size"] == (3, 256, 256) and cfg["crop_pct"] == 0.94 and cfg["interpolation"] == "bicubic"


SMALL = [n for n in list_models(task="image") if model_info(n).small]


@pytest.mark.parametrize("name", SMALL)
def test_classifier_and_feature_methods_compose_like_timms(name):
    torch.manual_seed(0)
    model = create_model(name, num_classes=7, in_chans=2).eval()
    size = min(model_info(name).input_size, 64)
    x = torch.randn(2, 2, size, size)
    cfg = model.pretrained_cfg
    modules = dict(model.named_modules())
    assert isinstance(modules[cfg["first_conv"]], torch.nn.Conv2d) and modules[cfg["first_conv"]].in_channels == 2
    assert modules[cfg["classifier"]] is model.get_classifier() and model.get_classifier().out_features == 7
    assert model.default_cfg is cfg and cfg["input_size"][0] == 2 and cfg["num_classes"] == 7
    with torch.no_grad():
        logits = model(x)
        features = model.forward_features(x)
        pooled = model.forward_head(features, pre_logits=True)
        assert torch.equal(model.forward_head(features), logits)
        assert pooled.shape == (2, model.num_features) and features.shape[:2] == (2, model.num_features)
        torch.testing.assert_close(model.get_classifier()(pooled), logits, rtol=0, atol=0)
        model.reset_classifier(3)
        assert model(x).shape == (2, 3) and cfg["num_classes"] == 3 and cfg["classes"] is None
        model.reset_classifier(0, global_pool="avg")
        assert torch.equal(model(x), pooled)  # no classifier: the pooled features
        model.reset_classifier(0, global_pool="")  # timm's "no pooling": the map itself
        assert torch.equal(model(x), features) and torch.equal(model.forward_head(features, pre_logits=True), features)
        model.reset_classifier(0)  # None: the pooling as it is
        assert torch.equal(model(x), features)
        model.reset_classifier(0, global_pool="avg")
        assert torch.equal(model(x), pooled)
    assert [f["num_chs"] for f in model.feature_info][-1] == model.num_features


def test_reset_classifier_rejects_what_it_cannot_build_in_one_line():
    model = create_model("resnet26", num_classes=4)
    for kwargs, needle in (({"num_classes": -1}, "num_classes"), ({"num_classes": 2, "global_pool": "max"},
                                                                 "global_pool"),
                           ({"num_classes": 2, "global_pool": ""}, r"global_pool '' \(no pooling\) needs num_classes")):
        with pytest.raises(ValueError, match=needle) as info:
            model.reset_classifier(**kwargs)
        assert "\n" not in str(info.value)


def test_timm_model_utilities_work_on_our_models():
    """timm.utils' EMA and freezing, which walk the model's modules and state."""
    from timm.utils import ModelEmaV3, freeze, unfreeze

    torch.manual_seed(0)
    model = create_model("lambda_resnet26", num_classes=5, in_chans=1)
    ema = ModelEmaV3(model, decay=0.5)
    before = {k: v.clone() for k, v in ema.module.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    name, ref = next((k, v) for k, v in before.items() if v.is_floating_point())
    torch.testing.assert_close(ema.module.state_dict()[name], 0.5 * ref + 0.5 * model.state_dict()[name])
    freeze(model, ["stem"])
    assert not any(p.requires_grad for p in model.stem.parameters())
    assert all(p.requires_grad for p in model.fc.parameters())
    unfreeze(model, ["stem"])
    assert all(p.requires_grad for p in model.stem.parameters())


@pytest.mark.parametrize("name", ["lambda_resnet26t", "lambda_resnet26rpt_256", "botnet26t_256"])
@pytest.mark.parametrize("size", [97, 225])
def test_timm_architectures_take_odd_input_sizes(name, size):
    """A map of odd side entering a strided block: the lambda layer's 2x2 pool and the block's 1x1 stride-2
    shortcut both give ``ceil(side / 2)`` (the pool gave the floor: a shape mismatch, as timm's own models fail),
    and a global layer built for ``img_size`` is sized by those rounded-up maps (it was built one smaller)."""
    model = create_model(name, img_size=size, num_classes=10).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, size, size)).shape == (1, 10)
    if name != "botnet26t_256":  # local lambdas take any size: the model built at the default size too
        with torch.no_grad():
            assert create_model(name, num_classes=10).eval()(torch.randn(1, 3, size, size)).shape == (1, 10)
