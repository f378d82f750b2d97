"""timm's feature and training conveniences on our image models: ``features_only`` with ``out_indices`` and its
``feature_info``, ``forward_intermediates`` / ``prune_intermediate_layers``, ``set_grad_checkpointing``,
``group_matcher`` and ``no_weight_decay`` (and the optimiser builder honouring it).

The expectations are timm's own models of the same architecture (their ``feature_info``, ``group_matcher``, group
sizes, optimiser groups and, on the same weights, their intermediate maps), the activations of the full model at
the modules ``feature_info`` names (forward hooks), and the non-checkpointed model's gradients.
"""

import copy

import pytest
import torch

from lambdanet.engine.optim import build_optimizer
from lambdanet.engine.state import RunState
from lambdanet.models import byoa, create_model, list_models
from test_models import DEEP_MODELS, DEPTH_REPEATS, slow_repeats

timm = pytest.importorskip("timm")
from timm.models import group_parameters  # noqa: E402

# our models whose architecture timm has (the same name, or MobileNet-v2 as timm's mobilenetv2_100)
TIMM_PEERS = {**{n: n for n in sorted(byoa.model_cfgs)}, **{f"resnet{d}": f"resnet{d}" for d in (26, 50, 101, 152)},
              "mobilenet_v2": "mobilenetv2_100"}
# resnet101 / 152 (resnet50's blocks, more of them) with -m slow, as in the sweeps over the zoo (test_models.py)
DEFAULT_PEERS = [pytest.param(n, marks=pytest.mark.slow) if n in DEPTH_REPEATS else n for n in sorted(TIMM_PEERS)]


def one_line_error(fn, needle):
    with pytest.raises(ValueError, match=needle) as info:
        fn()
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------ features_only


@pytest.mark.parametrize("name", DEFAULT_PEERS)
def test_feature_info_is_timms_for_the_same_architecture(name):
    """channels / reductions of every selection as timm's model of the architecture reports them (module names
    too for timm's byoa networks, whose module names we keep); our default selection is timm's (1, 2, 3, 4)."""
    peer = TIMM_PEERS[name]
    for out_indices in ((0, 1, 2, 3, 4), (1, 2, 3, 4), (0, 3), 2, (-1,)):
        with torch.device("meta"):
            ours = create_model(name, features_only=True, out_indices=out_indices)
            theirs = timm.create_model(peer, features_only=True, out_indices=out_indices)
        assert ours.feature_info.channels() == theirs.feature_info.channels(), out_indices
        assert ours.feature_info.reduction() == theirs.feature_info.reduction(), out_indices
        if name in byoa.model_cfgs:
            assert ours.feature_info.module_name() == theirs.feature_info.module_name(), out_indices
    with torch.device("meta"):
        default = create_model(name, features_only=True)
        theirs = timm.create_model(peer, features_only=True, out_indices=(1, 2, 3, 4))
    assert default.feature_info.channels() == theirs.feature_info.channels()
    assert [d["num_chs"] for d in default.feature_info] == theirs.feature_info.channels()  # a list of c2..c5


SMALL_CASES = [("resnet26", {"base_width": 8}), ("resnet_rs50", {"base_width": 8}), ("mobilenet_v2", {}),
               ("lambda_resnet26", {"stem": "cifar", "img_size": 32, "base_width": 8}), ("lambda_resnet26t", {})]


def hooked_maps(model, names, x):
    """The outputs of ``model``'s modules ``names`` during ``model(x)`` (copied: some are in-place activations)."""
    modules, seen = dict(model.named_modules()), {}
    handles = [modules[n].register_forward_hook(lambda m, i, o, n=n: seen.setdefault(n, o.clone())) for n in names]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return [seen[n] for n in names]


@pytest.mark.parametrize("name,kwargs", SMALL_CASES, ids=[c[0] for c in SMALL_CASES])
def test_features_only_maps_are_the_full_models_activations(name, kwargs):
    torch.manual_seed(0)
    full = create_model(name, num_classes=5, **kwargs).eval()
    x = torch.randn(2, 3, 32, 32)
    everything = create_model(name, features_only=True, out_indices=(0, 1, 2, 3, 4), **kwargs).eval()
    everything.load_state_dict({k: v for k, v in full.state_dict().items() if not k.startswith("fc.")})
    with torch.no_grad():
        want = hooked_maps(full, everything.feature_info.module_name(), x)
        got = everything(x)
        assert len(got) == 5 and all(torch.equal(g, w) for g, w in zip(got, want))
        assert [tuple(g.shape[1:2]) for g in got] == [(c,) for c in everything.feature_info.channels()]
        strides = [32 // g.shape[-1] for g in got]
        assert strides == everything.feature_info.reduction()
        for out_indices, picked in (((1, 3), [1, 3]), (2, [3, 4]), ((-1, 0), [0, 4]), (None, [1, 2, 3, 4])):
            some = create_model(name, features_only=True, out_indices=out_indices, **kwargs).eval()
            some.load_state_dict(everything.state_dict())
            assert all(torch.equal(g, want[i]) for g, i in zip(some(x), picked, strict=True))
            assert some.feature_info.out_indices == tuple(picked)


def test_forward_intermediates_follows_timms_contract():
    torch.manual_seed(0)
    model = create_model("resnet26", num_classes=4, base_width=8).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, maps = model.forward_intermediates(x)
        assert torch.equal(final, model.forward_features(x)) and torch.equal(model.forward_head(final), model(x))
        assert len(maps) == 5 and [m.shape[1] for m in maps] == model.feature_info.channels(list(range(5)))
        last_two = model.forward_intermediates(x, indices=2)[1]
        assert all(torch.equal(a, b) for a, b in zip(last_two, maps[3:], strict=True))
        picked = model.forward_intermediates(x, indices=[-1, 0], intermediates_only=True)
        assert len(picked) == 2 and torch.equal(picked[0], maps[0]) and torch.equal(picked[1], maps[4])  # depth order
        early, early_maps = model.forward_intermediates(x, indices=[1], stop_early=True)
        assert torch.equal(early, maps[1]) and len(early_maps) == 1 and torch.equal(early_maps[0], maps[1])
        assert all(torch.equal(a, b) for a, b in zip(model.forward_intermediates(x, norm=True)[1], maps))
    one_line_error(lambda: model.forward_intermediates(x, output_fmt="NHWC"), "output_fmt must be 'NCHW'")
    one_line_error(lambda: model.forward_intermediates(x, indices=[5]), r"feature indices must be ints in -5\.\.4")
    one_line_error(lambda: model.forward_intermediates(x, indices=6), r"must be in 1\.\.5, got 6")
    one_line_error(lambda: create_model("resnet26", out_indices=(1, 2)), "pass features_only=True")
    one_line_error(lambda: create_model("resnet26", features_only=True, out_indices=(7,)), "feature indices")


def float64_pair(name, tmp_path, size):
    """timm's model with random weights and BatchNorm statistics, and ours loaded from its checkpoint, float64."""
    torch.manual_seed(0)
    peer = timm.create_model(name).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in peer.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    torch.save(peer.state_dict(), tmp_path / "peer.pth")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ours = create_model(name, checkpoint_path=tmp_path / "peer.pth")
    finally:
        torch.set_default_dtype(previous)
    x = torch.randn(1, 3, size, size, dtype=torch.float64, generator=g)
    return ours.eval(), peer.eval(), x


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_intermediates_and_pruning_equal_timms_on_the_same_weights(tmp_path):
    """timm's lambda_resnet26t and ours on one checkpoint: the same five maps (the last through final_conv), the
    same maps after pruning to (1, 2), the same indices returned and the same parameters left. Float64: a correct
    pair differs by rounding (~1e-14 relative), a wrong map by far more than the 1e-10 bound."""
    ours, peer, x = float64_pair("lambda_resnet26t", tmp_path, 64)
    with torch.no_grad():
        for kwargs in ({}, {"indices": 2}, {"indices": [0, 2], "stop_early": True}):
            f_ours, ours_maps = ours.forward_intermediates(x, **kwargs)
            f_peer, peer_maps = peer.forward_intermediates(x, **kwargs)
            assert len(ours_maps) == len(peer_maps) and rel_err(f_ours, f_peer) < 1e-10, kwargs
            assert all(rel_err(a, b) < 1e-10 for a, b in zip(ours_maps, peer_maps)), kwargs
        assert ours.prune_intermediate_layers((1, 2)) == peer.prune_intermediate_layers((1, 2)) == [1, 2]
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in peer.parameters())
        got = ours.forward_intermediates(x, indices=(1, 2), intermediates_only=True)
        want = peer.forward_intermediates(x, indices=(1, 2), intermediates_only=True)
        assert len(got) == 2 and all(rel_err(a, b) < 1e-10 for a, b in zip(got, want))
        # forward of a pruned model: the last map kept, unpooled, as timm's (was pooled to [b, c])
        got, want = ours(x), peer(x)
        assert got.shape == want.shape and want.dim() == 4
        assert rel_err(got, want) < 1e-10
    assert ours.get_classifier().__class__ is torch.nn.Identity and ours.pretrained_cfg["num_classes"] == 0


def test_pruning_keeps_the_maps_and_drops_what_follows():
    torch.manual_seed(0)
    model = create_model("mobilenet_v2", num_classes=3).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        maps = model.forward_intermediates(x, intermediates_only=True)
        before = sum(p.numel() for p in model.parameters())
        assert model.prune_intermediate_layers(indices=(0, 2)) == [0, 2]
        assert len(model.features) == 7  # stem + the rows up to c3 (features.6)
        assert sum(p.numel() for p in model.parameters()) < before and isinstance(model.fc, torch.nn.Identity)
        got = model.forward_intermediates(x, indices=(0, 2), intermediates_only=True)
        assert torch.equal(got[0], maps[0]) and torch.equal(got[1], maps[2])


# -------------------------------------------------------------------------------------- grad checkpointing


@pytest.mark.parametrize("name,kwargs", [("resnet26", {"base_width": 8}),
                                         ("lambda_resnet26", {"stem": "cifar", "img_size": 16, "base_width": 8})])
def test_grad_checkpointing_recomputes_blocks_and_keeps_the_gradients(name, kwargs):
    """float64, training mode with stochastic depth (its masks must be drawn again identically on recomputation):
    the gradients of every parameter equal the plain model's; each block runs twice per step (forward and
    recomputation) instead of once, and once without gradients."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        plain = create_model(name, num_classes=5, drop_path_rate=0.3, zero_init_last=False, **kwargs).train()
    finally:
        torch.set_default_dtype(previous)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    weight = torch.randn(4, 5, dtype=torch.float64)
    calls = {}

    def counted(tag, forward):  # the block's forward itself (checkpoint recomputes it without running hooks)
        def run(*args):
            calls[tag] = calls.get(tag, 0) + 1
            return forward(*args)
        return run

    for tag, model in (("plain", plain), ("ckpt", ckpt)):
        block = model.stages[2][0]
        block.forward = counted(tag, block.forward)
        torch.manual_seed(1)
        (model(x) * weight).sum().backward()
        torch.manual_seed(1)  # features_only's path: forward_intermediates
        sum(m.square().mean() for m in model.forward_intermediates(x, intermediates_only=True)).backward()
    assert calls == {"plain": 2, "ckpt": 4}
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        scale = float(a.grad.abs().max()) or 1.0
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-12 * scale, msg=n)
    with torch.no_grad():
        ckpt(x)
    assert calls["ckpt"] == 5
    ckpt.set_grad_checkpointing(False)
    ckpt(x).sum().backward()
    assert calls["ckpt"] == 6


# ---------------------------------------------------------------------------------------- group_matcher


@pytest.mark.parametrize("name", DEFAULT_PEERS)
def test_group_matcher_groups_like_timms_model(name):
    """Every parameter in exactly one group (timm's group_parameters), the stem first, the classifier last; the
    groups hold as many parameters as timm's model's groups, fine and coarse (for timm's byoa networks the
    matcher itself is timm's)."""
    with torch.device("meta"):
        ours, theirs = create_model(name), timm.create_model(TIMM_PEERS[name])
    for coarse in (False, True):
        groups = group_parameters(ours, ours.group_matcher(coarse=coarse))
        names = [n for _, members in sorted(groups.items()) for n in members]
        assert sorted(names) == sorted(n for n, _ in ours.named_parameters()) and len(set(names)) == len(names)
        ordered = [members for _, members in sorted(groups.items())]
        assert all(n.startswith(("stem.", "features.0.")) for n in ordered[0])
        assert ordered[-1] == ["fc.weight", "fc.bias"]
        sizes = []
        for model in (ours, theirs):
            params = dict(model.named_parameters())
            found = group_parameters(model, model.group_matcher(coarse=coarse))
            sizes.append([sum(params[n].numel() for n in members) for _, members in sorted(found.items())])
        assert sizes[0] == sizes[1], coarse
        if name in byoa.model_cfgs:
            assert ours.group_matcher(coarse) == theirs.group_matcher(coarse)


# ------------------------------------------------------------------------------------- no_weight_decay

POSITION_SUFFIXES = ("embedding.weight", ".rel_h", ".rel_w", ".rel", ".position_bias")


@pytest.mark.parametrize("name", ["lambda_resnet26", "lambda_resnet26t", "lambda_resnet26rpt_256", "botnet26t_256",
                                  "halonet26t", "halonet_h0", "resnet26", "mobilenet_v2_lambda"])
def test_no_weight_decay_names_the_position_tables(name):
    with torch.device("meta"):
        model = create_model(name)
    expected = {n for n, _ in model.named_parameters() if n.endswith(POSITION_SUFFIXES)}
    assert model.no_weight_decay() == expected
    assert bool(expected) == (name != "resnet26")


def test_optimizer_groups_are_timms_and_old_checkpoints_regroup():
    """build_optimizer's groups are those timm's optimiser factory makes from the model's no_weight_decay(); an
    optimiser state saved with lambdanet 0.1's groups (1-d tensors alone undecayed) is restored per parameter."""
    from timm.optim import create_optimizer_v2

    torch.manual_seed(0)
    model = create_model("lambda_resnet26", num_classes=3, stem="cifar", img_size=16, base_width=8)
    ours = build_optimizer(model, name="adamw", lr=1e-3, weight_decay=0.05)
    theirs = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)

    def split(opt):
        return [{id(p) for g in opt.param_groups if (g["weight_decay"] > 0) == decayed for p in g["params"]}
                for decayed in (True, False)]

    assert split(ours) == split(theirs)
    embeddings = [p for n, p in model.named_parameters() if n.endswith("embedding.weight")]
    assert embeddings and all(id(p) in split(ours)[1] for p in embeddings)
    params = list(model.parameters())
    old = torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.05},
                             {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}], lr=1e-3)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    old.step()
    saved = RunState(model, old).state_dict()
    restored = RunState(model, build_optimizer(model, name="adamw", lr=1e-3, weight_decay=0.05))
    restored.load_state_dict(saved)
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(restored.optimizer.state[p][key], old.state[p][key])
    decay_of = {id(p): g["weight_decay"] for g in restored.optimizer.param_groups for p in g["params"]}
    assert all(decay_of[id(p)] == 0.0 for p in embeddings)


@pytest.mark.parametrize("name", slow_repeats(list_models(task="image"), DEPTH_REPEATS | DEEP_MODELS))
def test_every_image_model_has_the_interface(name):
    with torch.device("meta"):
        model = create_model(name)
    for method in ("forward_intermediates", "prune_intermediate_layers", "set_grad_checkpointing",
                   "group_matcher", "no_weight_decay"):
        assert callable(getattr(model, method)), (name, method)
    assert len(model.feature_info.info) == 5 and model.feature_info.out_indices == (1, 2, 3, 4)
