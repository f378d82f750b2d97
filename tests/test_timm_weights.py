"""timm's twelve ImageNet attention checkpoints on our layers (lambdanet.models.byoa / .pretrained).

For each architecture, timm's own model (the peer) is built with random weights and random BatchNorm
statistics, saved as a timm checkpoint and loaded through ``create_model(name, checkpoint_path=FILE)``:
the parameter counts must be equal and the logits equal in float64. The bound, a relative max error of
1e-5, is the issue's; the float64 rounding of a 26-50-layer network is ~1e-14 relative, and a wrong
conversion (a kv layout not de-interleaved, a mirrored lambda kernel, a missing bias) gives 1e-3 to 1e-2
(checked by hand when the converter was written), so the bound separates the two by orders of magnitude.
``pretrained=True`` is tested with the download mocked: no test touches the network.
"""

import pytest
import torch

from lambdanet.models import byoa, create_model
from lambdanet.models import pretrained as weights

timm = pytest.importorskip("timm")

NAMES = sorted(byoa.model_cfgs)
# 3-15 s each on 2 cores (timm's float64 halo attention is slow): the default suite keeps one model per
# convention (local and global lambda, halo with ECA and groups, BoTNet, and lamhalobotnet50ts_256: the 50-layer
# trunk with all three attention kinds); the others repeat their blocks and run with -m slow
SLOW = {"haloregnetz_b", "halonet50ts", "lambda_resnet50ts", "halo2botnet50ts_256", "sehalonet33ts",
        "sebotnet33ts_256", "halonet26t"}


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random BatchNorm statistics and affine parameters (well conditioned: |scale| < 1), random biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) * 0.4 + 0.2)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model.eval()


def timm_checkpoint(name: str, path, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    peer = randomize(timm.create_model(name, **kwargs).double())
    torch.save(peer.state_dict(), path)
    return peer


def create_float64(name: str, **kwargs) -> torch.nn.Module:
    """``create_model`` with float64 parameters from the start (loading float64 weights into float32
    parameters would round them)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return create_model(name, **kwargs).eval()
    finally:
        torch.set_default_dtype(previous)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


# Tolerance of the float64 comparisons with timm's model on the same weights: each layer's outputs are sums of at
# most 3 * 3 * 512 = 4608 products, ~50 layers deep; float64 rounds each at u = 1.1e-16, so a correct pair differs
# by ~sqrt(terms) u ~ 1e-14 per layer at most (random-sign rounding; measured 3e-16 - 5e-16 of the largest logit
# for every model here), and 1e-10 still leaves four orders of magnitude. The former 1e-5 let a BatchNorm eps
# twice timm's (2e-5 for 1e-5: off by 3e-6 - 4e-6) pass as timm's model.
F64_TOL = 1e-10


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in NAMES])
def test_timm_checkpoint_gives_timms_logits(name, tmp_path):
    path = tmp_path / f"{name}.pth"
    peer = timm_checkpoint(name, path)
    ours = create_float64(name, checkpoint_path=path)
    assert n_params(ours) == n_params(peer)
    size = byoa.model_cfgs[name].pretrained.input_size
    x = torch.randn(1, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = peer(x), ours(x)
    assert rel_err(got, want) <= F64_TOL
    assert ours.pretrained_cfg["load_notes"] == []


def test_parameter_counts_equal_timms_at_the_checkpoint_size():
    for name in NAMES:
        with torch.device("meta"):
            assert n_params(create_model(name)) == n_params(timm.create_model(name)), name


def test_pretrained_cfg_is_the_checkpoints_preprocessing():
    for name in NAMES:
        cfg = timm.models.get_pretrained_cfg(byoa.model_cfgs[name].pretrained.hub_id.removeprefix("timm/"))
        with torch.device("meta"):
            ours = create_model(name).pretrained_cfg
        assert ours["input_size"] == cfg.input_size, name
        assert ours["crop_pct"] == cfg.crop_pct and ours["interpolation"] == cfg.interpolation, name
        assert ours["mean"] == pytest.approx(cfg.mean) and ours["std"] == pytest.approx(cfg.std), name
        assert ours["hf_hub_id"] == "timm/" + f"{cfg.architecture}.{cfg.tag}", name


@pytest.fixture(scope="module")
def botnet_file(tmp_path_factory):
    """One timm BoTNet checkpoint shared by the tests below (they only read it)."""
    path = tmp_path_factory.mktemp("botnet") / "botnet26t_256.pth"
    return path, timm_checkpoint("botnet26t_256", path)


def test_fine_tuning_gets_a_new_classifier_and_keeps_the_trunk(botnet_file):
    path, peer = botnet_file
    ours = create_float64("botnet26t_256", checkpoint_path=path, num_classes=10)
    assert ours.fc.out_features == 10
    assert "1000-class classifier is not loaded" in ours.pretrained_cfg["load_notes"][0]
    x = torch.randn(1, 3, 256, 256, dtype=torch.float64)
    with torch.no_grad():  # the pooled features are timm's
        assert rel_err(ours.forward_head(ours.forward_features(x), pre_logits=True),
                       peer.forward_head(peer.forward_features(x), pre_logits=True)) <= F64_TOL


def test_grey_model_sees_a_grey_image_as_the_rgb_checkpoint_does(botnet_file):
    """in_chans=1: the stem is summed over RGB, so a grey image equals the RGB model on R = G = B."""
    path, peer = botnet_file
    ours = create_float64("botnet26t_256", checkpoint_path=path, in_chans=1)
    grey = torch.randn(1, 1, 256, 256, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(ours(grey), peer(grey.expand(1, 3, 256, 256))) <= F64_TOL


def test_lambdanet_weights_load_as_they_are(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = randomize(create_float64("lambda_resnet26t", num_classes=5))
    save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    dst = create_float64("lambda_resnet26t", num_classes=5, checkpoint_path=tmp_path / "w.safetensors")
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), k


def test_a_checkpoint_of_another_model_is_refused(botnet_file):
    path, _ = botnet_file
    with pytest.raises(weights.WeightsMismatchError, match="does not fit halonet26t: .* missing keys"):
        create_model("halonet26t", checkpoint_path=path)
    with pytest.raises(ValueError, match="does not exist"):
        create_model("halonet26t", checkpoint_path=path.parent / "nope.pth")


# --------------------------------------------------------------------------- pretrained=True, offline
@pytest.fixture
def hub(monkeypatch, tmp_path, botnet_file):
    """The hub mocked: ``calls`` records downloads; ``offline`` makes them fail as without a network."""
    path, peer = botnet_file
    state = {"calls": [], "offline": False}

    def download(repo_id):
        state["calls"].append(repo_id)
        if state["offline"]:
            raise OSError("Cannot reach https://huggingface.co: no network")
        return str(path)

    monkeypatch.setattr(weights, "download_weights", download)
    monkeypatch.setenv("LAMBDANET_CACHE", str(tmp_path / "cache"))
    state["peer"] = peer
    return state


def test_pretrained_cache_miss_downloads_converts_and_caches(hub, tmp_path):
    model = create_float64("botnet26t_256", pretrained=True)
    assert hub["calls"] == ["timm/botnet26t_256.c1_in1k"]
    assert (tmp_path / "cache" / "botnet26t_256.safetensors").is_file()
    x = torch.randn(1, 3, 256, 256, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(model(x), hub["peer"](x)) <= F64_TOL


def test_pretrained_cache_hit_needs_no_network(hub):
    create_model("botnet26t_256", pretrained=True)
    hub["offline"] = True
    model = create_float64("botnet26t_256", pretrained=True)  # from the cache
    assert hub["calls"] == ["timm/botnet26t_256.c1_in1k"]
    x = torch.randn(1, 3, 256, 256, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(model(x), hub["peer"](x)) <= F64_TOL


def test_pretrained_offline_names_the_hub_id_and_checkpoint_path(hub, tmp_path):
    hub["offline"] = True
    with pytest.raises(weights.PretrainedUnavailableError) as err:
        create_model("botnet26t_256", pretrained=True)
    msg = str(err.value)
    assert "timm/botnet26t_256.c1_in1k" in msg and "checkpoint_path=FILE" in msg and "no network" in msg
    # each command's way (detect has no --checkpoint: its backbone's own option, its pre-training off)
    assert "train: --checkpoint FILE; detect: --backbone-kwargs checkpoint_path=FILE --pretrain-steps 0" in msg
    assert "\n" not in msg
    assert not (tmp_path / "cache" / "botnet26t_256.safetensors").exists()


def test_pretrained_loading_names_the_published_checkpoint_and_what_became_of_its_classifier(hub, tmp_path):
    """A published checkpoint that does not fit (global attention built at another size) was called
    ``checkpoint_path '<cache file>'``, a path the user never gave; a features-only model was told its classifier
    had "a new one (1000 classes)"."""
    with pytest.raises(weights.WeightsMismatchError) as err:
        create_model("botnet26t_256", pretrained=True, img_size=128)
    msg = str(err.value)
    assert msg.startswith("the published checkpoint of botnet26t_256 (timm/botnet26t_256.c1_in1k, cached at ")
    assert "checkpoint_path" not in msg and "does not fit botnet26t_256" in msg
    notes = create_model("botnet26t_256", pretrained=True, features_only=True).pretrained_cfg["load_notes"]
    assert notes == ["the checkpoint's 1000-class classifier is not loaded: the model has no classifier"]
    notes = create_model("botnet26t_256", pretrained=True, num_classes=3).pretrained_cfg["load_notes"]
    assert notes == ["the checkpoint's 1000-class classifier is not loaded: the model has a new one (3 classes)"]


@pytest.mark.parametrize("name", ["botnet26t_256", "lambda_resnet26rpt_256"])
def test_global_attention_built_for_a_non_square_size_gives_timms_logits(name, tmp_path):
    """timm builds its architectures for ``img_size=(H, W)``; ours took only an int ("img_size must be a positive
    int"). On timm's weights at (96, 128), the logits equal timm's (float64, the bound above)."""
    path = tmp_path / f"{name}.pth"
    peer = timm_checkpoint(name, path, img_size=(96, 128))
    ours = create_float64(name, checkpoint_path=path, img_size=(96, 128))
    x = torch.randn(1, 3, 96, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(ours(x), peer(x)) <= F64_TOL
    assert ours.pretrained_cfg["input_size"] == (3, 96, 128)


def test_pretrained_on_a_model_without_weights_lists_those_with():
    with pytest.raises(ValueError, match="no pretrained weights are published for 'resnet50'.*lambda_resnet26t"):
        create_model("resnet50", pretrained=True)
    with pytest.raises(ValueError, match="not both"):
        create_model("botnet26t_256", pretrained=True, checkpoint_path="x.pth")
