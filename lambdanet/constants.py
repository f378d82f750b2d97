"""Constants every level of the package shares (the bottom of the dependency stack: imports nothing)."""

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "DEFAULT_CROP_PCT", "DEFAULT_INTERPOLATION", "DATASET_CLASSES"]

# ImageNet's per-channel (RGB) mean and standard deviation: the normalisation of every published checkpoint
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
# torchvision's ImageNet evaluation: resize the shorter side to size / 0.875, centre-crop size x size
DEFAULT_CROP_PCT = 0.875
DEFAULT_INTERPOLATION = "bilinear"
# the class names of the built-in datasets that have them, by label (torchvision's; CIFAR-100's come with its files)
DATASET_CLASSES: dict[str, tuple[str, ...]] = {
    "fashion-mnist": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
}
