"""Every parameter's gradient has its parameter's strides.

``DistributedDataParallel`` lays each gradient bucket out with its parameter's strides and warns "Grad strides
do not match bucket view strides" (then copies, every step) when a ``.grad`` arrives in another layout.
Autograd's ``AccumulateGrad`` keeps a gradient whose strides differ from the parameter's only on size-1 axes
(a 1x1 convolution's ``[o, i, 1, 1]`` weight, a one-channel stem's ``[o, 1, 3, 3]``), so an exact stride
comparison is the check DDP makes.
"""

import pytest
import torch

from lambdanet import LambdaLayer
from lambdanet.tasks.classification.data import ImageLoader, TensorImages, dataset_spec
from lambdanet.models import create_model, list_models, model_info


def mismatched_grads(model, x):
    """``(name, param strides, grad strides)`` of every parameter whose gradient has other strides."""
    for p in model.parameters():
        p.grad = None
    model(x).float().square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    return [(name, p.stride(), p.grad.stride()) for name, p in model.named_parameters()
            if p.grad.stride() != p.stride()]


def channels_last(model, x):
    fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
    return model.to(memory_format=fmt), x.contiguous(memory_format=fmt)


LAYERS = [  # (impl, kwargs, input shape, the plan step that must run)
    ("conv", dict(r=5), (2, 8, 8, 8), "conv"),
    ("depthwise_conv", dict(r=5), (2, 8, 8, 8), "depthwise_conv_tokens"),
    ("einsum", dict(r=5), (2, 8, 8, 8), "einsum"),
    ("einsum_qe", dict(r=5), (2, 8, 8, 8), "einsum_qe_whole"),
    ("conv", dict(r=None, feat_size=8), (2, 8, 8, 8), "conv"),
    ("depthwise_conv", dict(r=None, feat_size=8), (2, 8, 8, 8), "depthwise_conv_tokens"),
    ("einsum", dict(r=None, feat_size=8), (2, 8, 8, 8), "einsum"),
    ("einsum_qe", dict(r=None, feat_size=8), (2, 8, 8, 8), "einsum_qe_whole"),
    ("auto", dict(r=None, feat_size=30), (1, 8, 30, 29), "einsum_qe_chunked"),  # > 852 positions
    ("einsum_qe", dict(r=None, feat_size=8, position_embedding="absolute"), (2, 8, 8, 8), "einsum_qe_absolute"),
    ("einsum", dict(r=None, feat_size=8, position_embedding="absolute"), (2, 8, 8, 8), "einsum_absolute"),
    ("conv", dict(r=5, dim_u=2, multihead=True), (2, 8, 8, 8), "conv"),
    ("depthwise_conv", dict(r=3, spatial_dims=3), (2, 8, 5, 4, 6), "depthwise_conv_tokens"),
]


@pytest.mark.parametrize("memory_format", ["channels_first", "channels_last"])
@pytest.mark.parametrize("impl,kwargs,shape,step", LAYERS,
                         ids=[f"{i}-{s}-{'-'.join(map(str, kw.values()))}" for i, kw, _, s in LAYERS])
def test_lambda_layer_grads_have_parameter_strides(impl, kwargs, shape, step, memory_format):
    torch.manual_seed(0)
    layer = LambdaLayer(shape[1], 16, dim_k=2, heads=2, impl=impl, **kwargs)
    assert layer.plan(shape[2:]).position == step  # the case covers the step it names
    x = torch.randn(*shape)
    if memory_format == "channels_last":
        layer, x = channels_last(layer, x)
    assert mismatched_grads(layer, x) == []


SMALL_MODELS = [name for name in list_models(task="image") if model_info(name).small]


def small_model(name, in_chans):
    torch.manual_seed(0)
    return create_model(name, num_classes=10, in_chans=in_chans, stem="cifar", base_width=16, img_size=16)


def test_the_small_models_are_the_hybrid_and_its_convolutional_twin():
    assert {"resnet26", "lambda_resnet26"} <= set(SMALL_MODELS)


@pytest.mark.parametrize("memory_format", ["channels_first", "channels_last"])
@pytest.mark.parametrize("in_chans", [1, 3])
@pytest.mark.parametrize("name", SMALL_MODELS)
def test_small_model_grads_have_parameter_strides(name, in_chans, memory_format):
    model = small_model(name, in_chans)
    x = torch.randn(4, in_chans, 16, 16)
    if memory_format == "channels_last":
        model, x = channels_last(model, x)
    assert mismatched_grads(model, x) == []


@pytest.mark.parametrize("memory_format", ["channels_first", "channels_last"])
def test_training_batches_of_one_channel_images_keep_parameter_strides(memory_format):
    """The DDP warning of a ``train`` run on one-channel data: the augmented batch must be laid out as the
    model expects. A ``[b, 1, h, w]`` batch whose strides are those of ``[b, h, w, 1]`` (a crop built
    channels-last, whose ``.contiguous()`` is a no-op for one channel) sends a channels-first model down
    channels-last convolutions, and the 1x1 convolutions' weight gradients come back ``[o, i, 1, 1]`` with
    strides ``(i, 1, i, i)`` instead of the weight's ``(i, 1, 1, 1)``."""
    spec = dataset_spec("digits")  # one channel, small: the vectorised crop-and-flip path
    g = torch.Generator().manual_seed(0)
    data = TensorImages(torch.randint(0, 256, (16, 1, 16, 16), dtype=torch.uint8, generator=g),
                        torch.arange(16) % 10)
    loader = ImageLoader(data, spec, 16, train=True, batch_size=8, seed=0)
    x, _ = next(iter(loader))
    model = small_model("lambda_resnet26", spec.in_chans)
    if memory_format == "channels_last":  # the trainer's --channels-last: model and batch converted
        model, x = channels_last(model, x)
    else:  # a channels-first model gets the batch as it is, which must then be the canonical NCHW layout
        assert x.stride() == torch.empty(x.shape).stride(), f"batch strides {x.stride()} are not NCHW's"
    assert mismatched_grads(model, x) == []
