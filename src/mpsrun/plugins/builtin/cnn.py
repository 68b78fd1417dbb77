"""Built-in `cnn` model: a small convolutional network, the next step up from `mlp`."""

from __future__ import annotations

from torch import nn


def cnn(
    input_shape: tuple[int, ...],
    num_classes: int,
    channels: list[int] = [32, 64],  # noqa: B006 - shown as the default in `mpsrun plugins`
    hidden: int = 128,
    dropout: float = 0.25,
    batch_norm: bool = False,
) -> nn.Module:
    """Small convolutional network: per entry of `channels`, conv3x3-ReLU-maxpool2; then hidden-unit head.

    Made for 28x28 images (28 -> 14 -> 7 with the default two stages) but built for any
    C x H x W input_shape: each stage halves H and W, and the flattened size is worked
    out from input_shape, so 8x8 digits or 32x32 RGB work too as long as each stage
    leaves at least 1x1. batch_norm adds BatchNorm2d after each convolution.
    """
    if len(input_shape) != 3:
        raise ValueError(f"cnn needs images shaped C x H x W, got input_shape {tuple(input_shape)}")
    if not channels:
        raise ValueError("cnn needs at least one entry in channels")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    c, h, w = input_shape
    layers: list[nn.Module] = []
    for i, out in enumerate(channels):
        if h < 2 or w < 2:
            raise ValueError(
                f"cnn: input {tuple(input_shape)} is too small for {len(channels)} stages "
                f"(stage {i + 1} would see {h}x{w}); use fewer channels entries"
            )
        layers.append(nn.Conv2d(c, out, kernel_size=3, padding=1, bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm2d(out))
        layers += [nn.ReLU(), nn.MaxPool2d(2)]
        c, h, w = out, h // 2, w // 2
    layers += [nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU()]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(hidden, num_classes))
    return nn.Sequential(*layers)
