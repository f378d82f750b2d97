"""Detection and instance segmentation (lambdanet.tasks.detection): the glyph dataset, COCO folders and conversion,
COCO evaluation against independent expectations, and Mask R-CNN over lambda / halo backbones."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from lambdanet.tasks.detection import glyphs as det_glyphs
from lambdanet.tasks.detection.data import (
    GlyphInstances,
    GlyphSceneConfig,
    build_detection_datasets,
    dataset_to_coco,
    generate_glyph_scenes,
    glyph_cache_path,
    glyph_scenes,
    instance_target,
    size_class,
    size_statistics,
)
from lambdanet.tasks.detection.evaluate import METRICS, evaluate_detector, evaluate_predictions
from lambdanet.tasks.detection.coco import coco_ground_truth
from lambdanet.tasks.detection.model import (
    BACKBONE_PRESETS,
    DetectorOptions,
    create_detector,
    create_feature_backbone,
    detector_input_size,
)
from lambdanet.layers import ConvLayer, HaloAttention, SqueezeExcite
from lambdanet.models import register_model, unregister_model

SCENES = GlyphSceneConfig(train_images=12, test_images=24, glyphs="digits")  # machine-independent glyphs
SEED = 3
# a detector small enough for CPU tests; score threshold 0 so that an untrained model still returns detections
SMALL = DetectorOptions(fpn_channels=32, representation_size=64, mask_head_channels=32, rpn_batch_size_per_image=64,
                        box_batch_size_per_image=64, anchor_sizes=(16, 32, 64, 128, 256), box_score_thresh=0.0,
                        box_detections_per_img=20)
ALL_METRICS = [f"{t}_{m}" for t in ("bbox", "segm") for m in METRICS]


@pytest.fixture(scope="module")
def scenes() -> dict:
    return generate_glyph_scenes(SCENES, SEED)


def cropped_sample(scenes: dict, index: int, height: int, width: int) -> tuple[torch.Tensor, dict]:
    """Scene ``index`` of the train split cropped to ``height x width`` (sizes that are not multiples of 32)."""
    image, target = GlyphInstances("train", scenes=scenes)[index]
    masks = target["masks"][:, :height, :width]  # n h w
    keep = masks.flatten(1).sum(dim=1) > 0  # n
    return image[:, :height, :width], instance_target(masks[keep], target["labels"][keep], target["image_id"])


# ------------------------------------------------------------------------------------------------ dataset
def test_glyph_scenes_are_deterministic(scenes):
    again = generate_glyph_scenes(SCENES, SEED)
    for split in ("train", "test"):
        for key, value in scenes[split].items():
            assert torch.equal(value, again[split][key]), (split, key)
    other = generate_glyph_scenes(GlyphSceneConfig(train_images=2, test_images=1, glyphs="digits"), SEED + 1)
    assert not torch.equal(other["train"]["images"], scenes["train"]["images"][:2])


def test_glyph_cache_is_written_once_and_reread(scenes, tmp_path, monkeypatch):
    data = glyph_scenes(SCENES, SEED, cache_dir=tmp_path, progress=False)
    path = glyph_cache_path(SCENES, SEED, tmp_path)
    assert path.name.startswith(f"glyph-instances-{det_glyphs.VERSION}-{SEED}-") and path.suffix == ".pt"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # written atomically: no temporary file left

    def no_generation(*args, **kwargs):
        raise AssertionError("the cached scenes should have been read")

    monkeypatch.setattr(det_glyphs, "generate_glyph_scenes", no_generation)
    reread = glyph_scenes(SCENES, SEED, cache_dir=tmp_path, progress=False)
    for split in ("train", "test"):
        for key in ("images", "instances", "labels", "offsets"):
            assert torch.equal(reread[split][key], scenes[split][key])
            assert torch.equal(data[split][key], scenes[split][key])
    assert reread["categories"] == [str(d) for d in range(10)]
    monkeypatch.undo()
    path.write_bytes(b"truncated")  # a damaged cache file is regenerated
    assert torch.equal(glyph_scenes(SCENES, SEED, cache_dir=tmp_path, progress=False)["test"]["images"],
                       scenes["test"]["images"])


def test_glyph_targets_match_their_masks(scenes):
    for split in ("train", "test"):
        ds = GlyphInstances(split, scenes=scenes)
        assert len(ds) == (SCENES.train_images if split == "train" else SCENES.test_images)
        for i in range(len(ds)):
            image, t = ds[i]
            assert image.dtype == torch.float32 and image.shape == (3, 256, 256)
            assert 0 <= image.min() and image.max() <= 1
            n = len(t["labels"])
            assert 1 <= n <= SCENES.max_objects and t["image_id"] == i + 1
            assert t["masks"].dtype == torch.uint8 and t["masks"].shape == (n, 256, 256)
            assert t["labels"].dtype == torch.int64 and 1 <= t["labels"].min() and t["labels"].max() <= 10
            assert t["boxes"].dtype == torch.float32 and t["boxes"].shape == (n, 4)
            assert torch.equal(t["iscrowd"], torch.zeros(n, dtype=torch.int64))
            assert t["masks"].sum(dim=0).max() <= 1  # occlusion: every pixel belongs to one object at most
            for mask, box, area in zip(t["masks"], t["boxes"].tolist(), t["area"].tolist()):
                ys, xs = mask.nonzero(as_tuple=True)
                assert area == mask.sum() > 0
                assert box == [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]


def test_glyph_sizes_cover_the_coco_size_classes(scenes):
    for split in ("train", "test"):
        stats = size_statistics(GlyphInstances(split, scenes=scenes))
        assert stats["small"] + stats["medium"] + stats["large"] == stats["objects"]
        for kind in ("small", "medium", "large"):
            assert stats[kind] >= 0.1 * stats["objects"], (split, stats)
    assert (size_class(32 ** 2 - 1), size_class(32 ** 2), size_class(96 ** 2), size_class(96 ** 2 + 1)) == (
        "small", "medium", "medium", "large")


def test_fully_hidden_glyphs_are_dropped(monkeypatch):
    placed = []
    place = det_glyphs.place

    def counting_place(*args, **kwargs):
        corner = place(*args, **kwargs)
        placed.append(corner is not None)
        return corner

    monkeypatch.setattr(det_glyphs, "place", counting_place)
    # crowded small images and no visibility requirement: later glyphs hide some earlier ones completely
    cfg = GlyphSceneConfig(image_size=96, train_images=4, test_images=1, glyphs="digits", max_objects=40,
                           min_visible=0.0, large_prob=0.0, small_prob=0.5)
    scenes = generate_glyph_scenes(cfg, 0)
    kept = 0
    for split in ("train", "test"):
        ds = GlyphInstances(split, scenes=scenes)
        for i in range(len(ds)):
            target = ds[i][1]
            kept += len(target["labels"])
            assert (target["area"] > 0).all()
            assert torch.equal(torch.unique(ds.instances[i]),
                               torch.arange(len(target["labels"]) + 1, dtype=torch.uint8))
    assert kept < sum(placed)  # some pasted glyphs were hidden and dropped, the others renumbered 1..n


def test_dataset_to_coco_encodes_masks_and_boxes(scenes):
    mask_utils = pytest.importorskip("pycocotools.mask")
    ds = GlyphInstances("test", scenes=scenes)
    coco = dataset_to_coco(ds)
    assert [c["id"] for c in coco["categories"]] == list(range(1, 11))
    assert [img["id"] for img in coco["images"]] == list(range(1, len(ds) + 1))
    anns = iter(coco["annotations"])
    for i in range(len(ds)):
        target = ds[i][1]
        for mask, box, label in zip(target["masks"], target["boxes"].tolist(), target["labels"].tolist()):
            ann = next(anns)
            assert ann["image_id"] == i + 1 and ann["category_id"] == label and ann["iscrowd"] == 0
            assert torch.equal(torch.from_numpy(mask_utils.decode(ann["segmentation"])), mask)
            assert ann["bbox"] == [box[0], box[1], box[2] - box[0], box[3] - box[1]]
            assert ann["bbox"] == mask_utils.toBbox(ann["segmentation"]).tolist()  # pycocotools' own convention
            assert ann["area"] == mask.sum().item()
    assert next(anns, None) is None
    assert len({a["id"] for a in coco["annotations"]}) == len(coco["annotations"]) and min(
        a["id"] for a in coco["annotations"]) == 1
    with pytest.raises(ValueError, match="dataset must name its categories"):
        dataset_to_coco(torch.utils.data.Subset(ds, [0]))


# --------------------------------------------------------------------------------------------- evaluation
def ground_truth_predictions(ds) -> list[dict]:
    return [{"image_id": t["image_id"], "boxes": t["boxes"], "labels": t["labels"], "masks": t["masks"],
             "scores": torch.ones(len(t["labels"]))} for t in (ds[i][1] for i in range(len(ds)))]


def test_ground_truth_as_predictions_scores_ap_one(scenes):
    pytest.importorskip("pycocotools")
    ds = GlyphInstances("test", scenes=scenes)
    gt = dataset_to_coco(ds)
    perfect = ground_truth_predictions(ds)
    metrics = evaluate_predictions(gt, perfect)
    assert sorted(metrics) == sorted(ALL_METRICS)
    assert all(value == pytest.approx(1.0) for value in metrics.values()), metrics
    # false positives (wrong class) scored below every true positive leave the precision at every recall at 1
    extra = [dict(p, labels=torch.cat([p["labels"], p["labels"] % 10 + 1]), boxes=torch.cat([p["boxes"]] * 2),
                  masks=torch.cat([p["masks"]] * 2), scores=torch.cat([p["scores"], torch.full_like(p["scores"], 0.5)]))
             for p in perfect]
    assert all(value == pytest.approx(1.0) for value in evaluate_predictions(gt, extra).values())
    # the wrong class only: disjoint masks never match another object; overlapping boxes rarely do
    wrong = evaluate_predictions(gt, [dict(p, labels=p["labels"] % 10 + 1) for p in perfect])
    assert all(wrong[f"segm_{m}"] == 0.0 for m in METRICS) and all(wrong[f"bbox_{m}"] < 0.01 for m in METRICS)


def test_shifted_predictions_score_lower(scenes):
    pytest.importorskip("pycocotools")
    ds = GlyphInstances("test", scenes=scenes)
    gt = dataset_to_coco(ds)
    shifted = [dict(p, boxes=p["boxes"] + 5, masks=p["masks"].roll(shifts=(5, 5), dims=(1, 2)))
               for p in ground_truth_predictions(ds)]
    metrics = evaluate_predictions(gt, shifted)
    for kind in ("bbox", "segm"):
        assert 0.0 <= metrics[f"{kind}_AP"] < 1.0
        assert metrics[f"{kind}_AP75"] <= metrics[f"{kind}_AP50"]
    assert metrics["bbox_AP_small"] < metrics["bbox_AP_large"]  # a 5 px shift costs small boxes the most IoU
    # images without predictions still count: no detections in every other image halves the recall
    half = ground_truth_predictions(ds)
    for p in half[::2]:
        p.update(boxes=p["boxes"][:0], labels=p["labels"][:0], masks=p["masks"][:0], scores=p["scores"][:0])
    assert evaluate_predictions(gt, half, ("bbox",))["bbox_AP"] < 0.75


# ---------------------------------------------------------------------------------------------- detectors
@pytest.mark.parametrize("backbone", ["resnet26", "lambda_resnet26"])
def test_detector_trains_and_predicts_on_odd_sizes(scenes, backbone):
    model = create_detector(backbone, 10, min_size=112, max_size=144, options=SMALL, base_width=8)
    assert model.__class__.__name__ == "MaskRCNN"
    samples = [cropped_sample(scenes, 0, 150, 170), cropped_sample(scenes, 1, 131, 97)]  # not multiples of 32
    images, targets = [s[0] for s in samples], [s[1] for s in samples]
    model.train()
    losses = model(images, targets)
    assert {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"} <= set(losses)
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    grads = [p.grad for p in model.backbone.body.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    model.eval()
    with torch.no_grad():
        outputs = model(images)
    for image, out in zip(images, outputs):
        n = len(out["scores"])
        assert n > 0 and out["boxes"].shape == (n, 4) and out["labels"].shape == (n,)
        assert out["masks"].shape == (n, 1, *image.shape[1:])
        assert (out["boxes"][:, 2] <= image.shape[2]).all() and (out["boxes"][:, 3] <= image.shape[1]).all()


def test_faster_rcnn_without_masks(scenes):
    model = create_detector("resnet26", 10, masks=False, min_size=96, max_size=128, options=SMALL, base_width=8).eval()
    assert model.__class__.__name__ == "FasterRCNN"
    with torch.no_grad():
        out = model([cropped_sample(scenes, 2, 100, 120)[0]])[0]
    assert set(out) == {"boxes", "labels", "scores"}


def test_mask_roi_size_sets_the_mask_heads_resolution(scenes):
    """The mask head upsamples its RoI features 2x: 14 -> 28 x 28 logits (torchvision's), 28 -> 56 x 56."""
    import dataclasses

    for size in (14, 28):
        opts = dataclasses.replace(SMALL, mask_roi_size=size)
        model = create_detector("resnet26", 10, min_size=96, max_size=128, options=opts, base_width=8)
        features = {k: torch.randn(1, opts.fpn_channels, 96 // s, 96 // s) for k, s in
                    zip(("0", "1", "2", "3"), (4, 8, 16, 32))}
        boxes = [torch.tensor([[10.0, 10.0, 60.0, 50.0]])]
        heads = model.roi_heads
        pooled = heads.mask_roi_pool(features, boxes, [(96, 96)])  # 1 c size size
        logits = heads.mask_predictor(heads.mask_head(pooled))
        assert pooled.shape[-1] == size and logits.shape[-2:] == (2 * size, 2 * size)
    with pytest.raises(ValueError, match="mask_roi_size"):
        DetectorOptions(mask_roi_size=0)


def test_the_glyph_note_names_the_sets_and_the_missing_package(monkeypatch, tmp_path):
    from lambdanet.tasks.detection import task as trainer

    assert trainer.glyph_note("digits+mnist5k") == "glyphs: digits+mnist5k"
    monkeypatch.setattr(det_glyphs, "FASHION_MNIST_DIR", tmp_path)  # not installed
    note = trainer.glyph_note("auto")
    assert note.startswith("glyphs: digits+mnist5k (auto)") and "apt-get install dataset-fashion-mnist" in note


def test_the_default_glyphs_do_not_depend_on_what_the_machine_has_installed(monkeypatch, tmp_path):
    """The default scenes, crops and detect runs draw the same glyphs with and without Fashion-MNIST's
    Debian package (the cause of a default whose mask AP moved by 0.08 between machines)."""
    import inspect

    from lambdanet.tasks.detection.pretrain import GlyphCrops, crop_scene_config, pretrain_backbone
    from lambdanet.tasks.detection.config import resolve_detect_config

    fake = tmp_path / "fashion"
    fake.mkdir()
    (fake / "train-images-idx3-ubyte.gz").touch()
    defaults = [GlyphSceneConfig().glyphs, resolve_detect_config().glyphs, crop_scene_config(64).glyphs,
                inspect.signature(GlyphCrops).parameters["glyphs"].default,
                inspect.signature(pretrain_backbone).parameters["glyphs"].default]
    assert len(set(defaults)) == 1
    resolved = []
    for root in (tmp_path / "absent", fake):
        monkeypatch.setattr(det_glyphs, "FASHION_MNIST_DIR", root)
        resolved.append(det_glyphs.resolve_glyph_sources(defaults[0]))
        assert det_glyphs.resolve_glyph_sources("auto") == (("digits", "fashion-mnist") if root == fake
                                                            else ("digits", "mnist5k"))  # what auto would do
    assert resolved[0] == resolved[1] == ("digits",)


def test_global_context_layers_are_sized_by_the_largest_padded_input():
    model = create_detector("resnet26", 3, min_size=100, max_size=150, options=SMALL, base_width=8,
                            stage_layers="CCCL", spatial_layer="lambda").eval()  # r=None: a global lambda in c5
    assert detector_input_size(150, 32) == 160 and model.backbone.body.img_size == (160, 160)
    with torch.no_grad():
        out = model([torch.rand(3, 150, 97), torch.rand(3, 60, 200)])  # the second is resized to 45 x 150
    assert len(out) == 2
    explicit = create_feature_backbone("resnet26", max_size=150, base_width=8, img_size=320)[0]
    assert explicit.img_size == (320, 320)


def test_halonet_table5_presets_replace_c5_convolutions_by_halo_attention():
    assert set(BACKBONE_PRESETS) == {f"resnet{d}_se{s}" for d in (26, 50, 101) for s in ("", "_halo_b8", "_halo_b32")}
    for block in (8, 32):
        body, name, kwargs = create_feature_backbone(f"resnet50_se_halo_b{block}", max_size=128, base_width=8)
        assert name == "resnet50" and kwargs["stage_layers"] == "CCCL" and kwargs["se"] is True
        stages = list(body.stages)
        assert [len(s) for s in stages] == [3, 4, 6, 3]
        for stage in stages[:3]:
            assert all(isinstance(b.spatial, ConvLayer) and isinstance(b.se, SqueezeExcite) for b in stage)
        for b in stages[3]:
            assert isinstance(b.spatial, HaloAttention) and not isinstance(b.se, SqueezeExcite)
            assert (b.spatial.block_size, b.spatial.halo_size, b.spatial.heads) == (block, 3, 8)
    model = create_detector("resnet50_se_halo_b8", 4, min_size=100, max_size=140, options=SMALL, base_width=8).eval()
    with torch.no_grad():  # 140 -> 160: c5 is 5 x 5, not a whole number of 8 x 8 blocks
        out = model([torch.rand(3, 100, 140)])[0]
    assert out["masks"].shape[1:] == (1, 100, 140)


def test_backbones_without_features_only_are_rejected():
    @register_model(args={"img_size": None})
    def detection_test_plain_cnn(*, num_classes: int = 1000, in_chans: int = 3, img_size=None) -> nn.Module:
        return nn.Conv2d(in_chans, 8, 3)

    try:
        with pytest.raises(ValueError, match="backbone 'detection_test_plain_cnn' has no features_only option"):
            create_detector("detection_test_plain_cnn", 3)
    finally:
        unregister_model("detection_test_plain_cnn")
    with pytest.raises(ValueError, match="backbone must be a registered model or one of BACKBONE_PRESETS"):
        create_detector("no_such_backbone", 3)
    with pytest.raises(ValueError, match="num_classes must be a positive int"):
        create_detector("resnet26", 0)


def test_a_frozen_backbone_stays_frozen_when_its_batchnorm_is_synchronised():
    """``--sync-bn`` on the CPU converts every BatchNorm to AllReduceBatchNorm after the detector froze them: the
    conversion built new parameters (``requires_grad`` on) and ``batch_norms()`` no longer found the layers to keep
    in eval mode, so a frozen backbone's statistics and affine parameters trained (torch's conversion on CUDA keeps
    the parameter objects). Frozen means the same tensors, no gradient, eval mode, after ``train()`` too."""
    from lambdanet.engine.distributed import AllReduceBatchNorm, convert_sync_batchnorm
    from lambdanet.models import create_model
    from lambdanet.tasks.detection.model import FeaturePyramidBackbone

    body = create_model("resnet26", base_width=8, num_classes=0, features_only=True)
    frozen = FeaturePyramidBackbone(body, 16, frozen_bn=True)
    before = {n: p for n, p in frozen.named_parameters() if "bn" in n}
    count = sum(isinstance(m, nn.BatchNorm2d) for m in body.modules())
    converted = convert_sync_batchnorm(frozen, torch.device("cpu")).train()
    norms = converted.batch_norms()
    assert len(norms) == count > 0
    assert all(isinstance(m, AllReduceBatchNorm) and not m.training for m in norms)
    after = dict(converted.named_parameters())
    assert before and all(after[n] is p and not p.requires_grad for n, p in before.items())
    x = torch.randn(2, 3, 64, 64)
    stats = [m.running_mean.clone() for m in norms]
    converted(x)  # training mode, a single process: the frozen layers' statistics do not move
    assert all(torch.equal(m.running_mean, s) for m, s in zip(norms, stats))


def test_evaluate_detector_reports_every_metric():
    pytest.importorskip("pycocotools")
    tiny = generate_glyph_scenes(GlyphSceneConfig(train_images=1, test_images=2, glyphs="digits"), 0)
    model = create_detector("resnet26", 10, min_size=128, max_size=128, options=SMALL, base_width=8)
    rng = torch.get_rng_state()
    metrics = evaluate_detector(model, GlyphInstances("test", scenes=tiny), batch_size=2)
    assert torch.equal(torch.get_rng_state(), rng)  # --eval-every between epochs leaves the training's draws alone
    assert model.training  # the mode it had
    assert sorted(metrics) == sorted(ALL_METRICS)
    assert all(math.isnan(v) or 0.0 <= v <= 1.0 for v in metrics.values())
    boxes_only = create_detector("resnet26", 10, masks=False, min_size=128, max_size=128, options=SMALL, base_width=8)
    assert sorted(evaluate_detector(boxes_only, GlyphInstances("test", scenes=tiny))) == sorted(ALL_METRICS[:6])


# ------------------------------------------------------------------------------------------- COCO folders
def write_coco_folder(root, *, annotations=None, images=None, categories=None) -> None:
    """A COCO folder with train and val splits: ``a.png`` (40 x 50, two objects of categories 3 and 7) and
    ``b.png`` (no objects); the keyword arguments replace the val file's lists."""
    from PIL import Image

    mask_utils = pytest.importorskip("pycocotools.mask")
    import numpy as np

    square = np.zeros((40, 50), dtype=np.uint8)
    square[5:15, 20:40] = 1
    rle = mask_utils.encode(np.asfortranarray(square))
    rle["counts"] = rle["counts"].decode("ascii")
    default_images = [{"id": 1, "file_name": "a.png", "width": 50, "height": 40},
                      {"id": 2, "file_name": "b.png", "width": 50, "height": 40}]
    default_annotations = [
        {"id": 1, "image_id": 1, "category_id": 3, "bbox": [2.0, 20.0, 10.0, 12.0], "area": 120.0, "iscrowd": 0,
         "segmentation": [[2.0, 20.0, 12.0, 20.0, 12.0, 32.0, 2.0, 32.0]]},
        {"id": 2, "image_id": 1, "category_id": 7, "bbox": [20.0, 5.0, 20.0, 10.0], "area": 200.0, "iscrowd": 0,
         "segmentation": rle}]
    default_categories = [{"id": 3, "name": "cat"}, {"id": 7, "name": "dog"}]
    (root / "annotations").mkdir(parents=True)
    for split in ("train", "val"):
        (root / split).mkdir()
        for name in ("a.png", "b.png"):
            Image.new("RGB", (50, 40), (200, 100, 50)).save(root / split / name)
        custom = split == "val"
        data = {"images": images if custom and images is not None else default_images,
                "annotations": annotations if custom and annotations is not None else default_annotations,
                "categories": categories if custom and categories is not None else default_categories}
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(data))


def test_coco_folder_loads_in_detection_format(tmp_path):
    pytest.importorskip("pycocotools")
    write_coco_folder(tmp_path)
    train, test = build_detection_datasets(f"coco:{tmp_path}")
    assert len(train) == len(test) == 2 and train.categories == ["cat", "dog"] and train.num_classes == 2
    image, target = test[0]
    assert image.shape == (3, 40, 50) and image.dtype == torch.float32 and 0 <= image.min() <= image.max() <= 1
    assert target["image_id"] == 1 and target["labels"].tolist() == [1, 2]  # category ids 3, 7 -> labels 1, 2
    assert target["boxes"].tolist() == [[2.0, 20.0, 12.0, 32.0], [20.0, 5.0, 40.0, 15.0]]
    assert target["masks"].shape == (2, 40, 50) and target["masks"].dtype == torch.uint8
    assert target["masks"][1].sum() == 200 and target["masks"][1, 5:15, 20:40].all()
    assert target["area"].tolist()[1] == 200.0
    _, empty = test[1]
    assert empty["boxes"].shape == (0, 4) and empty["masks"].shape == (0, 40, 50) and empty["labels"].shape == (0,)
    gt = test.to_coco()
    assert [c["id"] for c in gt["categories"]] == [1, 2] and [a["category_id"] for a in gt["annotations"]] == [1, 2]
    perfect = [{"image_id": t["image_id"], "boxes": t["boxes"], "labels": t["labels"], "masks": t["masks"],
                "scores": torch.ones(len(t["labels"]))} for t in (test[i][1] for i in range(2))]
    metrics = evaluate_predictions(gt, perfect)
    assert metrics["bbox_AP"] == pytest.approx(1.0) and metrics["segm_AP"] == pytest.approx(1.0)
    assert math.isnan(metrics["bbox_AP_large"])  # no large object in these images


@pytest.mark.parametrize("case, match", [
    ("box_outside",
     r"annotation 2 has bbox \[30.0, 5.0, 40.0, 10.0\] \(x, y, w, h\) outside its image 'a.png' of 50x40"),
    ("no_annotations", "has no annotations"),
    ("missing_image", r"1 of 3 image files are missing under .*val \(first: c.png\)"),
    ("unknown_category", r"annotation 2 has category_id 9, not among the categories \[3, 7\]"),
    ("short_polygon", r"annotation 1's segmentation has a polygon of 4 numbers \(at least 3 points"),
    ("empty_segmentation", r"annotation 1's segmentation is an empty list"),
    ("rle_size", r"annotation 2's segmentation is an RLE of size \[10, 10\], not its image's .* = \[40, 50\]"),
    ("no_width", r"image 2 needs file_name and positive integer width and height"),
    ("string_category", r"category ids must be integers, got \{'id': '3'"),
])
def test_coco_folder_errors_are_one_line(tmp_path, case, match):
    pytest.importorskip("pycocotools")
    write_coco_folder(tmp_path)  # for the default annotations
    good = json.loads((tmp_path / "annotations" / "instances_train.json").read_text())
    anns, images = good["annotations"], good["images"]
    if case == "box_outside":
        anns[1]["bbox"] = [30.0, 5.0, 40.0, 10.0]
        write_args = {"annotations": anns}
    elif case == "no_annotations":
        write_args = {"annotations": []}
    elif case == "missing_image":
        write_args = {"images": images + [{"id": 3, "file_name": "c.png", "width": 50, "height": 40}]}
    elif case == "unknown_category":
        anns[1]["category_id"] = 9
        write_args = {"annotations": anns}
    elif case in ("short_polygon", "empty_segmentation", "rle_size"):  # pycocotools' own tracebacks before
        which, seg = {"short_polygon": (0, [[2.0, 20.0, 12.0, 20.0]]), "empty_segmentation": (0, []),
                      "rle_size": (1, {**anns[1]["segmentation"], "size": [10, 10]})}[case]  # fmt: skip
        anns[which]["segmentation"] = seg
        write_args = {"annotations": anns}
    elif case == "no_width":
        write_args = {"images": [images[0], {k: v for k, v in images[1].items() if k != "width"}]}
    else:
        write_args = {"categories": [{"id": "3", "name": "cat"}, {"id": 7, "name": "dog"}]}
    root = tmp_path / "coco"
    write_coco_folder(root, **write_args)
    with pytest.raises(ValueError, match=match) as err:
        build_detection_datasets(f"coco:{root}")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case, match", [
    ("top_level_list", r"holds a JSON list, not an object with the lists images, annotations and categories"),
    ("image_without_id", r"image ids must be integers, got \{'file_name': 'b.png'"),
    ("string_image_id", r"image ids must be integers, got \{'id': 'i'"),
    ("duplicate_image_id", r"image id 1 is given twice \('a.png' and 'b.png'\); ids must be unique"),
    ("category_without_name", r"category 7 needs a name, got \{'id': 7\}"),
    ("string_bbox", r"annotation 1 needs bbox \[x, y, w, h\] of four numbers, got \['2', '20', '10', '12'\]"),
    ("nan_bbox", r"annotation 1 needs bbox \[x, y, w, h\] of four numbers, got \[nan, "),
    ("word_iscrowd", r"annotation 1 has iscrowd 'no', not 0 or 1"),
])
def test_malformed_coco_files_are_one_line_errors_not_tracebacks(tmp_path, case, match):
    """What pycocotools or torchvision would fail on deep inside (AttributeError, KeyError, TypeError) or silently
    get wrong (two images of one id: the annotations of one trained on the other's file), named in one line."""
    pytest.importorskip("pycocotools")
    write_coco_folder(tmp_path)
    path = tmp_path / "annotations" / "instances_train.json"
    data = json.loads(path.read_text())
    images, anns, cats = data["images"], data["annotations"], data["categories"]
    if case == "top_level_list":
        data = [data]
    elif case == "image_without_id":
        del images[1]["id"]
    elif case == "string_image_id":
        images[1]["id"] = "i"
    elif case == "duplicate_image_id":
        images[1]["id"] = 1
    elif case == "category_without_name":
        del cats[1]["name"]
    elif case == "string_bbox":
        anns[0]["bbox"] = ["2", "20", "10", "12"]
    elif case == "nan_bbox":
        anns[0]["bbox"] = [float("nan"), 20, 10, 12]
    else:
        anns[0]["iscrowd"] = "no"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match) as err:
        build_detection_datasets(f"coco:{tmp_path}")
    assert "\n" not in str(err.value)


def test_boxes_only_coco_files_train_faster_rcnn_and_images_of_another_size_are_named(tmp_path):
    """Without masks (``--no-masks``: Faster R-CNN) segmentations are neither needed nor read: a file of boxes
    alone (empty or missing ``segmentation``, as detection exports write) loads with the same boxes and labels and
    areas of the boxes; Mask R-CNN still refuses it. An image file whose size is not the one the file declares
    (against which its boxes were checked) is named when read, instead of its boxes being clamped away."""
    from PIL import Image

    pytest.importorskip("pycocotools")
    write_coco_folder(tmp_path)
    for split in ("train", "val"):
        path = tmp_path / "annotations" / f"instances_{split}.json"
        data = json.loads(path.read_text())
        data["annotations"][0]["segmentation"] = []
        del data["annotations"][1]["segmentation"]
        path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="annotation 1's segmentation is an empty list"):
        build_detection_datasets(f"coco:{tmp_path}")
    train, test = build_detection_datasets(f"coco:{tmp_path}", masks=False)
    _, target = test[0]
    assert target["boxes"].tolist() == [[2.0, 20.0, 12.0, 32.0], [20.0, 5.0, 40.0, 15.0]]
    assert target["labels"].tolist() == [1, 2] and "masks" not in target
    assert target["area"].tolist() == [120.0, 200.0]
    gt = test.to_coco()
    boxes = [{"image_id": t["image_id"], "boxes": t["boxes"], "labels": t["labels"],
              "scores": torch.ones(len(t["labels"]))} for t in (test[i][1] for i in range(len(test)))]  # fmt: skip
    assert evaluate_predictions(gt, boxes, iou_types=("bbox",))["bbox_AP"] == pytest.approx(1.0)
    Image.new("RGB", (25, 20)).save(tmp_path / "val" / "a.png")  # the file says 50 x 40
    with pytest.raises(ValueError, match=r"image 'a.png' is 25x20 pixels, the file says 50x40"):
        test[0]


def perfect_predictions(test):
    return [{"image_id": t["image_id"], "boxes": t["boxes"], "labels": t["labels"], "masks": t["masks"],
             "scores": torch.ones(len(t["labels"]))} for t in (test[i][1] for i in range(len(test)))]


def test_a_val_file_with_other_categories_or_ids_keeps_the_models_labels(tmp_path):
    """The model's label k is the training file's k-th category: a val file listing one more (unused) category
    shifted every label of the evaluation (AP of perfect predictions well below 1); annotation ids from 0 made
    COCOeval drop a match (id 0 counts as unmatched); a val annotation of a category the model lacks is refused."""
    pytest.importorskip("pycocotools")
    write_coco_folder(tmp_path)
    good = json.loads((tmp_path / "annotations" / "instances_train.json").read_text())
    cats = [{"id": 1, "name": "bird"}] + good["categories"]  # an unused category before the model's two
    anns = [{**a, "id": a["id"] - 1} for a in good["annotations"]]  # ids from 0, as some exporters write them
    root = tmp_path / "other"
    write_coco_folder(root, categories=cats, annotations=anns)
    train, test = build_detection_datasets(f"coco:{root}")
    assert test.categories == train.categories == ["cat", "dog"] and test[0][1]["labels"].tolist() == [1, 2]
    gt = test.to_coco()
    assert [a["id"] for a in gt["annotations"]] == [1, 2] and [c["id"] for c in gt["categories"]] == [1, 2]
    metrics = evaluate_predictions(gt, perfect_predictions(test))
    assert metrics["bbox_AP"] == pytest.approx(1.0) and metrics["segm_AP"] == pytest.approx(1.0)
    subset = torch.utils.data.Subset(test, [0])  # --max-eval-images: that image's own annotations, from the file
    fresh = test.to_coco()  # (pycocotools' evaluation edits the dict it is given)
    assert coco_ground_truth(subset)["annotations"] == [a for a in fresh["annotations"] if a["image_id"] == 1]
    renamed = tmp_path / "renamed"  # the same ids, other names: the labels would mean other things
    write_coco_folder(renamed, categories=[{"id": 3, "name": "dog"}, {"id": 7, "name": "cat"}])
    with pytest.raises(ValueError, match="names category 3 'dog', .*instances_train.json names it 'cat'"):
        build_detection_datasets(f"coco:{renamed}")
    bird = tmp_path / "bird"
    write_coco_folder(bird, categories=cats, annotations=[{**anns[0], "category_id": 1}])
    with pytest.raises(ValueError, match=r"annotation 0 has category_id 1, which .*instances_train.json does not "
                                         r"list \(the model's categories: \[3, 7\]\)"):
        build_detection_datasets(f"coco:{bird}")


def test_coco_images_are_read_as_training_reads_images(tmp_path):
    """16-bit images scaled to 8 bits (torchvision's reader clipped them to white), as classification reads them."""
    pytest.importorskip("pycocotools")
    import numpy as np
    from PIL import Image

    write_coco_folder(tmp_path)
    wide = np.linspace(0, 65535, 40 * 50).reshape(40, 50).astype(np.uint16)
    Image.fromarray(wide).save(tmp_path / "train" / "a.png")
    image, _ = build_detection_datasets(f"coco:{tmp_path}")[0][0]
    want = torch.from_numpy(np.rint(wide / 257.0)).float() / 255  # H W, every channel
    assert torch.equal(image, want.expand(3, -1, -1))


def test_unknown_detection_dataset_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown detection dataset 'voc'; valid: glyphs, coco:DIR"):
        build_detection_datasets("voc")
    with pytest.raises(ValueError, match=r"needs train and test annotation files"):
        build_detection_datasets(f"coco:{tmp_path}")


# ------------------------------------------------------------------------------------- full-size backbones
@pytest.mark.slow
@pytest.mark.parametrize("backbone, kwargs", [
    ("lambda_resnet26t", {}), ("halonet26t", {}), ("halonet_h0", {}), ("lambda_resnet50", {}),
    ("resnet50", {"stage_layers": "CCLL"}), ("resnet_rs50_se", {}), ("resnet50_se_halo_b8", {}),
    ("resnet50_se_halo_b32", {}), ("botnet26t_256", {}), ("lambda_resnet26rpt_256", {}),
])
def test_full_width_backbones_train_and_predict(scenes, backbone, kwargs):
    model = create_detector(backbone, 10, min_size=112, max_size=144, options=SMALL, **kwargs)
    image, target = cropped_sample(scenes, 0, 150, 170)
    losses = model([image], [target])
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    with torch.no_grad():
        out = model.eval()([image])[0]
    assert out["masks"].shape[1:] == (1, 150, 170)
