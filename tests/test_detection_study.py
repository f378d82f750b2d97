"""The detection study's pieces: its four backbones, backbone-only cost (lambdanet.bench.detection_bench),
the RPN's proposal budget, and glyph-crop pre-training of the backbone (lambdanet.tasks.detection.pretrain)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from lambdanet.bench.detection_bench import backbone_costs, memory_slopes
from lambdanet.tasks.detection.model import (
    STUDY_BACKBONES,
    DetectorOptions,
    create_detector,
    create_feature_backbone,
)
from lambdanet.tasks.detection.pretrain import (
    GlyphCrops,
    PretrainConfig,
    batch_share,
    load_backbone_weights,
    pretrain_backbone,
    transfer_mismatch,
)
from lambdanet.tasks.detection.config import quick_backbone_kwargs, resolve_detect_config
from lambdanet.layers import ConvLayer, HaloAttention, LambdaLayer, SqueezeExcite
from lambdanet.runtime import peak_memory


# ---------------------------------------------------------------------------------------- study backbones
def test_study_backbones_are_a_resnet_its_se_twin_and_its_lambda_and_halo_hybrids():
    bodies = {}
    for name in STUDY_BACKBONES:
        assert quick_backbone_kwargs(name) == {"base_width": 16}  # presets too: the model under them
        bodies[name] = create_feature_backbone(name, max_size=256, **quick_backbone_kwargs(name))[0]
    spatial = {name: [[type(b.spatial) for b in stage] for stage in body.stages] for name, body in bodies.items()}
    assert all([len(s) for s in layers] == [2, 2, 2, 2] for layers in spatial.values())
    assert spatial["resnet26"] == spatial["resnet26_se"] == [[ConvLayer] * 2] * 4
    assert spatial["lambda_resnet26"] == [[ConvLayer] * 2] * 2 + [[LambdaLayer] * 2] * 2
    assert spatial["resnet26_se_halo_b8"] == [[ConvLayer] * 2] * 3 + [[HaloAttention] * 2]
    se = {name: [isinstance(b.se, SqueezeExcite) for stage in body.stages for b in stage]
          for name, body in bodies.items()}
    assert not any(se["resnet26"]) and all(se["resnet26_se"]) and not any(se["lambda_resnet26"])
    params = {name: sum(p.numel() for p in body.parameters()) for name, body in bodies.items()}
    # "of comparable size": the SE gates add 2 C^2 / 16 per block (about 10%); attention replaces 3x3
    # convolutions (9 C^2 weights) by 1x1 projections, so the hybrids are smaller, not larger
    se_params = sum(p.numel() for stage in bodies["resnet26_se"].stages for b in stage for p in b.se.parameters())
    assert params["resnet26_se"] == params["resnet26"] + se_params
    assert all(0.5 * params["resnet26"] <= params[n] < params["resnet26"] for n in ("lambda_resnet26",
                                                                                    "resnet26_se_halo_b8")), params


def test_rpn_proposal_budget_is_an_option():
    opts = DetectorOptions(fpn_channels=16, representation_size=32, mask_head_channels=16,
                           rpn_pre_nms_top_n=(60, 40), rpn_post_nms_top_n=(30, 12), box_score_thresh=0.0)
    model = create_detector("resnet26", 3, min_size=64, max_size=64, options=opts, base_width=8)
    assert (model.rpn.pre_nms_top_n(), model.rpn.post_nms_top_n()) == (60, 30)  # training
    model.eval()
    assert (model.rpn.pre_nms_top_n(), model.rpn.post_nms_top_n()) == (40, 12)
    with torch.no_grad():
        images, _ = model.transform([torch.rand(3, 64, 64)])
        proposals, _ = model.rpn(images, model.backbone(images.tensors))
    assert len(proposals[0]) <= 12
    for bad in ((100, 0), 500, (1, 2, 3)):
        with pytest.raises(ValueError, match=r"DetectorOptions.rpn_post_nms_top_n must be two positive ints"):
            DetectorOptions(rpn_post_nms_top_n=bad)


def test_channels_last_backbone_computes_the_same_pyramid():
    """The channels-last layout changes how oneDNN sums, not what: pyramid maps and gradients agree with the
    contiguous layout's to float32 rounding (sums of a few hundred terms per convolution over ~30 layers with
    BatchNorm: relative errors ~1e-6; bound 1e-4 of the largest magnitude)."""
    opts = {"fpn_channels": 16, "representation_size": 32, "mask_head_channels": 16}
    torch.manual_seed(0)
    plain = create_detector("lambda_resnet26", 3, min_size=96, max_size=96, options=DetectorOptions(**opts),
                            base_width=8)
    fast = create_detector("lambda_resnet26", 3, min_size=96, max_size=96,
                           options=DetectorOptions(**opts, channels_last=True), base_width=8)
    fast.load_state_dict(plain.state_dict())  # checkpoints move between the layouts
    convs = [m.weight for m in fast.backbone.body.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs if w.shape[-1] > 1)
    x = torch.rand(2, 3, 96, 96)
    outs = {}
    for name, model in (("plain", plain), ("fast", fast)):
        model.train()
        pyramid = model.backbone(x)
        assert all(p.is_contiguous() for p in pyramid.values())  # the heads see ordinary maps
        sum((p * torch.linspace(-1, 1, p.numel()).view_as(p)).sum() for p in pyramid.values()).backward()
        outs[name] = (pyramid, {k: p.grad for k, p in model.backbone.named_parameters() if p.grad is not None})
    (p0, g0), (p1, g1) = outs["plain"], outs["fast"]
    for k in p0:
        assert (p0[k] - p1[k]).abs().max() <= 1e-4 * p0[k].abs().max(), k
    assert g0.keys() == g1.keys()
    for k in g0:
        assert (g0[k] - g1[k]).abs().max() <= 1e-4 * g0[k].abs().max() + 1e-12, k
    with pytest.raises(ValueError, match="DetectorOptions.channels_last must be true or false"):
        DetectorOptions(channels_last="yes")


# ------------------------------------------------------------------------------------------ backbone cost
def test_memory_slopes_recover_the_growth_exponent():
    rows = [{"backbone": name, "size": s, "batch": b, "forward_peak_bytes": c * (s * s) ** e * b,
             "train_peak_bytes": 3 * c * (s * s) ** e * b}
            for name, e, c in (("linear", 1, 5.0), ("quadratic", 2, 1e-3)) for s in (512, 768, 1024) for b in (1, 2)]
    slopes = {r["backbone"]: r for r in memory_slopes(rows)}
    assert slopes["linear"]["forward_memory_slope"] == pytest.approx(1.0)
    assert slopes["quadratic"]["train_memory_slope"] == pytest.approx(2.0)
    assert slopes["linear"]["area_ratio"] == pytest.approx(4.0) and slopes["linear"]["batch"] == 1
    assert slopes["quadratic"]["train_peak_ratio"] == pytest.approx(16.0)


def test_backbone_costs_measure_each_backbone_alone():
    rows = backbone_costs(["lambda_resnet26"], sizes=(64,), batches=(1, 2), repeats=1, log=lambda _: None)
    assert [(r["size"], r["batch"]) for r in rows] == [(64, 1), (64, 2)]
    body = create_feature_backbone("lambda_resnet26", max_size=64, base_width=16)[0]
    assert all(r["params"] == sum(p.numel() for p in body.parameters()) for r in rows)
    for r in rows:
        assert r["forward_ms"] > 0 and r["train_ms"] > 0
        # training keeps the activations for backward: more than inference, which frees them as it goes
        assert r["train_peak_bytes"] > r["forward_peak_bytes"] > 0
    # a second image adds its activations, but not a second copy of the parameters' gradients (4 bytes per
    # parameter), which the batch-1 peak already holds
    grads = 4 * rows[0]["params"]
    assert rows[0]["train_peak_bytes"] > grads
    assert rows[0]["train_peak_bytes"] < rows[1]["train_peak_bytes"] < 2 * rows[0]["train_peak_bytes"] - grads / 2


@pytest.mark.parametrize("name", ["lambda_resnet26", "resnet26_se_halo_b8"])
def test_lambda_convolution_and_halo_backbone_memory_is_linear_in_area(name):
    """LambdaNetworks Table 2: lambda convolutions and blocked local attention cost Theta(b n m) memory for a
    fixed context m, so the peak of a forward pass grows with the area n (x2.25 from 512 to 768 px); global
    attention would grow it x5. At these sizes c4 has more than ImplPolicy.max_whole_positions (852)
    positions, so the lambda layers run as convolutions (below it they may materialise E [n, m], quadratic
    by design, capped at max_whole_elements), and c5 is a whole number of 8 x 8 halo blocks."""
    peaks = {}
    for size in (512, 768):
        torch.manual_seed(0)
        body = create_feature_backbone(name, max_size=size, base_width=16)[0].eval()
        x = torch.randn(1, 3, size, size)  # 1 3 s s

        def forward(body=body, x=x):
            with torch.no_grad():
                body(x)

        peaks[size] = peak_memory(forward)
    # the returned maps c2..c5 and the largest live intermediates all scale with the area; only the
    # position embeddings (kilobytes) do not
    assert 2.0 < peaks[768] / peaks[512] < 2.5, peaks


# ------------------------------------------------------------------------------------------- pre-training
def test_glyph_crops_are_deterministic_single_glyphs():
    crops = GlyphCrops("train", 8, img_size=48, seed=1, glyphs="digits")
    image, label = crops[3]
    again, label_again = GlyphCrops("train", 8, img_size=48, seed=1, glyphs="digits")[3]
    assert torch.equal(image, again) and label == label_again
    assert image.shape == (3, 48, 48) and 0.0 <= image.min() and image.max() <= 1.0
    assert {crops[i][1] for i in range(8)} <= set(range(len(crops.categories)))
    assert len(crops.categories) == 10
    with pytest.raises(IndexError):
        crops[8]


@pytest.mark.parametrize("batch, world", [(64, 1), (64, 2), (64, 3), (64, 7), (5, 5), (12, 5)])
def test_pretraining_shares_partition_every_batch(batch, world):
    shares = [batch_share(batch, r, world) for r in range(world)]
    items = [first + j for first, count in shares for j in range(count)]
    assert items == list(range(batch))  # each crop once, in order
    assert max(c for _, c in shares) - min(c for _, c in shares) <= 1


def test_pretrained_backbone_loads_into_the_detector_body():
    cfg = PretrainConfig(steps=2, batch_size=4, img_size=32, warmup_steps=1, eval_images=4)
    state, info = pretrain_backbone("resnet26_se", cfg, glyphs="digits", progress=False, log=lambda _: None,
                                    base_width=8)
    body = create_feature_backbone("resnet26_se", max_size=64, base_width=8)[0]
    assert set(state) == set(body.state_dict())  # the classifier is left out, nothing else
    load_backbone_weights(body, state)
    assert all(torch.equal(v, state[k]) for k, v in body.state_dict().items())
    assert 0.0 <= info["pretrain_accuracy"] <= 1.0 and info["pretrain_time_s"] > 0
    # crops rendered by a worker process are the same crops in the same order: the very same weights
    other, _ = pretrain_backbone("resnet26_se", dataclasses.replace(cfg, workers=1), glyphs="digits",
                                 progress=False, log=lambda _: None, base_width=8)
    assert other.keys() == state.keys() and all(torch.equal(other[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="PretrainConfig.workers must be a non-negative int"):
        PretrainConfig(workers=-1)
    state.pop("stem.0.weight" if "stem.0.weight" in state else next(iter(state)))
    with pytest.raises(ValueError, match="pre-trained weights do not fit the backbone"):
        load_backbone_weights(body, state)


def test_the_detectors_amp_reaches_the_glyph_pre_training(monkeypatch):
    """``detect --amp bf16`` autocast the detector's steps but not the 1,200 steps of the glyph pre-training before
    them: ``PretrainConfig.amp``, which the detector's ``_pretrain`` sets from ``--amp``."""
    from lambdanet.engine.distributed import DistContext
    from lambdanet.tasks.detection import pretrain as P
    from lambdanet.tasks.detection import task as T
    from lambdanet.tasks.detection.config import DetectConfig

    seen, build = [], P._classifier

    def classifier(*args):
        out = build(*args)
        out[0].register_forward_hook(lambda m, i, o: seen.append(torch.is_autocast_enabled("cpu")) if m.training
                                     else None)  # fmt: skip
        return out

    monkeypatch.setattr(P, "_classifier", classifier)
    cfg = PretrainConfig(steps=2, batch_size=4, img_size=32, warmup_steps=1, eval_images=4, amp="bf16")
    pretrain_backbone("resnet26_se", cfg, glyphs="digits", progress=False, log=lambda _: None, base_width=8)
    assert seen == [True, True]  # each training step autocast
    with pytest.raises(ValueError, match=r"PretrainConfig.amp must be one of \['none', 'bf16', 'fp16'\]"):
        PretrainConfig(amp="fp32")
    asked = []
    monkeypatch.setattr(T, "pretrain_backbone", lambda backbone, settings, **kw: asked.append(settings) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        T._pretrain(torch.nn.Module(), DetectConfig(amp="bf16", pretrain_steps=3), DistContext(), print)
    assert (asked[0].amp, asked[0].steps) == ("bf16", 3)


def test_pretraining_continues_from_its_checkpoint_to_the_same_weights(tmp_path, power_cut):
    from lambdanet.engine.checkpoint import load_checkpoint

    cfg = PretrainConfig(steps=4, batch_size=4, img_size=32, warmup_steps=1, eval_images=4)
    quiet = {"glyphs": "digits", "progress": False, "log": lambda _: None, "base_width": 8}
    whole, whole_info = pretrain_backbone("resnet26_se", cfg, **quiet)
    whole_rng = torch.get_rng_state()  # what the detector's training goes on with
    path = tmp_path / "pretrain.pt"
    with power_cut(4), pytest.raises(RuntimeError, match="power cut"):  # step 3 saved, step 4 dies
        pretrain_backbone("resnet26_se", cfg, checkpoint=path, checkpoint_every=3, **quiet)
    assert load_checkpoint(path)["step"] == 3
    logs = []
    resumed, info = pretrain_backbone("resnet26_se", cfg, checkpoint=path, checkpoint_every=3,
                                      **{**quiet, "log": logs.append})
    assert any(f"{path}: 3/4 steps done" in line for line in logs)
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], v) for k, v in whole.items())
    assert info["pretrain_accuracy"] == whole_info["pretrain_accuracy"]
    assert torch.equal(torch.get_rng_state(), whole_rng)
    assert load_checkpoint(path)["step"] == 3  # the last step is not saved: the caller keeps the result
    with pytest.raises(ValueError, match="holds another pre-training"):  # another seed: not this training's
        pretrain_backbone("resnet26_se", cfg, seed=1, checkpoint=path, **quiet)
    with pytest.raises(ValueError, match="checkpoint_every must be a positive int, got 0"):
        pretrain_backbone("resnet26_se", cfg, checkpoint=path, checkpoint_every=0, **quiet)


def test_input_sized_layers_do_not_transfer_from_crops():
    assert transfer_mismatch("lambda_resnet26", {"base_width": 16}, img_size=64, max_size=512) is None
    mismatch = transfer_mismatch("botnet26t_256", {}, img_size=64, max_size=512)
    assert mismatch is not None and "rel" in mismatch  # BoTNet's global relative tables are sized by the input
    assert resolve_detect_config(overrides={"backbone": "botnet26t_256"}).pretrain_steps == 0  # quick: none
    with pytest.raises(ValueError, match="cannot initialise backbone 'botnet26t_256'"):
        resolve_detect_config(overrides={"backbone": "botnet26t_256", "pretrain_steps": 5})


def test_detect_run_pretrains_then_fine_tunes(tmp_path, capsys):
    from lambdanet.cli import main

    pytest.importorskip("pycocotools")
    out = tmp_path / "run"
    assert main(["detect", "--backbone", "resnet26", "--pretrain-steps", "1", "--epochs", "1", "--batch-size", "2",
                 "--max-train-batches", "1", "--max-eval-images", "2", "--eval-batch-size", "2", "--img-size", "64",
                 "--no-progress", "--no-tensorboard", "--backbone-kwargs", "base_width=8", "--detector",
                 "{box_batch_size_per_image: 16, rpn_batch_size_per_image: 16, box_detections_per_img: 10}",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    pretrained = json.loads((out / "pretrain.json").read_text())
    assert pretrained["pretrain_accuracy"] == summary["pretrain_accuracy"]
    assert "pre-training resnet26" in capsys.readouterr().out
    assert main(["detect", "--out", str(out), "--resume", "--epochs", "2", "--no-progress"]) == 0
    assert "pre-training" not in capsys.readouterr().out  # resuming keeps the pre-trained, fine-tuned weights
    assert json.loads((out / "pretrain.json").read_text()) == pretrained


@pytest.mark.parametrize("overrides, match", [
    ({"pretrain_steps": 5, "pretrained_backbone": True}, "pretrain_steps and pretrained_backbone"),
    ({"pretrain_steps": 5, "data": "coco:/nowhere"}, "only the glyphs data has"),
    ({"pretrain_steps": -1}, "pretrain_steps must be a non-negative int"),
])
def test_pretraining_conflicts_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        resolve_detect_config(overrides=overrides)


def test_bench_detection_part_writes_rows_slopes_and_its_section(tmp_path):
    from lambdanet.bench.runner import run_benchmarks

    results = run_benchmarks(["detection"], quick=True, out=tmp_path, log=lambda _: None)
    rows = json.loads((tmp_path / "detection.json").read_text())
    assert {(r["backbone"], r["size"]) for r in rows} == {(b, s) for b in STUDY_BACKBONES for s in (64, 96, 128)}
    assert [r["backbone"] for r in results["detection_slopes"]] == list(STUDY_BACKBONES)
    assert "## Detection backbones" in (tmp_path / "bench.md").read_text()


def test_quick_recipe_pretrains_on_glyphs_only():
    from lambdanet.tasks.detection.config import QUICK_PRETRAIN_STEPS

    assert resolve_detect_config().pretrain_steps == QUICK_PRETRAIN_STEPS > 0
    assert resolve_detect_config(overrides={"data": "coco:/data/coco"}).pretrain_steps == 0
    assert resolve_detect_config(overrides={"pretrained_backbone": True}).pretrain_steps == 0
    assert resolve_detect_config("paper").pretrain_steps == 0
    assert resolve_detect_config(overrides={"pretrain_steps": 7}).pretrain_steps == 7


def test_study_table_has_table6_columns_in_percent(tmp_path, capsys):
    from lambdanet.tasks.detection.study import main, study_table

    summary = {"backbone_params": 592832, "train_time_s": 900.0, "bbox_AP": 0.3, "bbox_AP_small": 0.1,
               "bbox_AP_medium": 0.35, "bbox_AP_large": float("nan"), "segm_AP": 0.25, "segm_AP_small": 0.05,
               "segm_AP_medium": 0.3, "segm_AP_large": 0.6}
    bench = [{"backbone": "lambda_resnet26", "size": s, "batch": b, "train_ms": 100.0 * b * s / 1024,
              "train_peak_bytes": 2 ** 20 * b * s} for s in (512, 1024) for b in (1, 2)]
    lines = study_table({"lambda_resnet26": summary}, bench).splitlines()
    assert lines[0].split(" | ")[2:6] == ["AP bb", "AP bb s/m/l", "AP mask", "AP mask s/m/l"]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == [STUDY_BACKBONES["lambda_resnet26"], "0.59", "30.0", "10.0/35.0/-", "25.0", "5.0/30.0/60.0",
                     "100 / 1024", "200 / 2048"]
    run = tmp_path / "lambda_resnet26"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary))
    assert main([str(tmp_path)]) == 0 and "30.0" in capsys.readouterr().out
    assert main([str(tmp_path / "none")]) == 2 and "no " in capsys.readouterr().err
    assert main([str(tmp_path), str(tmp_path / "missing.json")]) == 2
    assert "no benchmark rows" in capsys.readouterr().err


def test_study_refuses_runs_of_different_recipes_and_ignores_where_they_ran(tmp_path, capsys):
    """Table 6 compares backbones trained alike: the study reads each run's config.yaml (as ``lambdanet detect``
    writes it) and refuses rows whose recipes differ, naming the option; where and how a run ran does not count."""
    from lambdanet.engine.values import load_yaml
    from lambdanet.tasks.detection.study import main, recipe_mismatch

    summary = {"backbone_params": 1, "train_time_s": 1.0, "bbox_AP": 0.3}
    runs = {"resnet26": {"out": str(tmp_path / "resnet26"), "device": "cpu", "workers": 1},
            "lambda_resnet26": {"out": str(tmp_path / "lambda_resnet26"), "eval_every": 2, "progress": False}}
    for name, overrides in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
        resolve_detect_config(overrides={"backbone": name, **overrides}).save_yaml(tmp_path / name / "config.yaml")
    assert main([str(tmp_path)]) == 0 and "30.0" in capsys.readouterr().out
    shorter = resolve_detect_config(overrides={"backbone": "resnet26", "epochs": 3})
    shorter.save_yaml(tmp_path / "resnet26" / "config.yaml")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "epochs differs" in err and "resnet26 3" in err and "lambda_resnet26 9" in err
    (tmp_path / "resnet26" / "config.yaml").write_text("epochs: [")
    assert main([str(tmp_path)]) == 2 and "not valid YAML" in capsys.readouterr().err
    # what --resume may change (the local processes) does not count; an option a run written before it existed
    # lacks counts as what that run ran with: 0.1.0's detect wrote no loss_weights (its default, {}, ran)
    old = load_yaml(Path(__file__).parent / "fixtures" / "runs_v1" / "detect" / "config.yaml")
    assert "loss_weights" not in old
    same = resolve_detect_config(overrides={k: v for k, v in old.items() if k not in ("backbone", "out")}
                                 | {"backbone": "lambda_resnet26", "procs": 2})  # fmt: skip
    assert recipe_mismatch({"resnet26": old, "lambda_resnet26": dataclasses.asdict(same)}) is None
    assert "lr differs" in recipe_mismatch({"resnet26": old, "lambda_resnet26": {**old, "lr": 0.01}})
    # one COCO at two mount points (backbones trained on two machines) is the same data; another folder is not
    here, there = {**old, "data": "coco:/mnt/a/coco"}, {**old, "data": "coco:/data/coco"}
    assert recipe_mismatch({"resnet26": here, "lambda_resnet26": there}) is None
    other = recipe_mismatch({"resnet26": here, "lambda_resnet26": {**old, "data": "coco:/mnt/a/coco_small"}})
    assert other is not None and other.startswith("data differs")
    assert recipe_mismatch({"resnet26": here, "lambda_resnet26": {**old, "data": "glyphs"}}).startswith("data differs")
