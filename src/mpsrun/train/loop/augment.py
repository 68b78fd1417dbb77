"""Training-image augmentation on the device, with random parameters per sample.

Why not torchvision's v2 transforms: called on a batch, they draw one crop, one flip and
one jitter for the whole batch, which is not augmentation. Here every sample draws its
own parameters from the device's default generator (seeded by the run's seed, so the
same seed gives the same batches), and the work is batched tensor code without a host
sync, so it runs inside a captured CUDA graph (a replay draws new numbers) and on MPS.

The geometric augmentations (random_resized_crop, random_horizontal_flip, random_crop)
are each an affine map from output to input coordinates; they are composed per sample
into one (N, 2, 3) matrix and applied by one `grid_sample` (bilinear), straight from
the raw uint8 batch to the output size. Then the colour ones (color_jitter: brightness,
contrast, saturation, in that order) on values in [0, 1], then normalisation. Deviations
from torchvision, said here so nobody is surprised: a crop larger than the image is
clamped to it instead of being redrawn, the jitter order is fixed, and the bilinear
resize has no antialiasing (torchvision's tensor resize antialiases when it shrinks).

Validation and test only resize to the augmented size and normalise: `eval_transform`
is an `ImageTransform`, the one the logged model carries.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from mpsrun.plugins.contract import ImageTransform


Rand = Callable[..., torch.Tensor]  # rand(*cols) -> (n, *cols) uniform numbers for this process's n samples


class AugmentError(ValueError):
    """The augmentation cannot apply to this dataset: bad input (exit 2)."""


def _hw(size: Any, default: tuple[int, int]) -> tuple[int, int]:
    if size is None:
        return default
    if isinstance(size, int):
        return (size, size)
    return (int(size[0]), int(size[1]))


@dataclass
class DeviceAugment:
    """The training transform: raw (N, C, H, W) batch -> augmented, scaled, normalised float batch."""

    steps: list[tuple[str, Any]]  # (name, checked arguments) in recipe order
    in_hw: tuple[int, int]  # the image size the augmentations see (after the dataset's own resize)
    out_hw: tuple[int, int]
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rgb: bool = False
    # Under DDP: this step's place in the global batch (`shards.StepWeight`: `start`, `total`), set by the batches'
    # iterator. Every rank seeds the same, so each draws the parameters for the whole global batch and keeps its own
    # slice: the samples get what one process would give them, and the generators advance as one process's does.
    share: Any = None
    # mean and std per device, made on the first call: a CUDA graph capture forbids host-to-device copies
    _coef: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def _mean_std(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(dev)
        if key not in self._coef:
            self._coef[key] = (torch.tensor(self.mean, device=dev).view(1, -1, 1, 1), torch.tensor(self.std, device=dev).view(1, -1, 1, 1))
        return self._coef[key]

    def _affine_coef(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaling and normalising as one `a * x + b`, when no colour step needs values in [0, 1] between them."""
        key = f"affine:{dev}"
        if key not in self._coef:
            mean, std = self._mean_std(dev)
            self._coef[key] = (self.scale / std, -mean / std)
        return self._coef[key]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[0], x.shape[1]
        dev = x.device
        start, total = (self.share.start, self.share.total) if self.share is not None and self.share.total else (0, n)

        def rand(*cols: int) -> torch.Tensor:  # this rank's rows of a draw for the whole (global) batch
            u = torch.rand(total, *cols, device=dev)
            return u if total == n else u[start : start + n]

        theta, zeros = self._theta(n, dev, rand)
        x = x.float()
        if theta is not None or tuple(x.shape[-2:]) != self.out_hw:
            if theta is None:
                theta = _affine(*([torch.ones(n, device=dev)] * 2 + [torch.zeros(n, device=dev)] * 2))[:, :2, :]
            grid = F.affine_grid(theta, [n, c, *self.out_hw], align_corners=False)
            x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros" if zeros else "border", align_corners=False)
        if any(name == "color_jitter" for name, _ in self.steps):
            x = x * self.scale
            for name, a in self.steps:
                if name == "color_jitter":
                    x = _jitter(x, a, rand)
            mean, std = self._mean_std(dev)
            x = (x - mean) / std
        else:
            a_, b_ = self._affine_coef(dev)
            x = torch.addcmul(b_, x, a_)
        if self.rgb and c == 1:
            x = x.expand(-1, 3, -1, -1)
        return x

    def _theta(self, n: int, dev: torch.device, rand: Rand) -> tuple[Optional[torch.Tensor], bool]:
        """Per-sample output->input maps (normalised coordinates), composed in recipe order."""
        m: Optional[torch.Tensor] = None
        zeros = False
        hw = self.in_hw
        for name, a in self.steps:
            if name == "random_resized_crop":
                step, hw = _resized_crop(n, dev, hw, a, rand)
            elif name == "random_crop":
                step, hw = _crop(n, dev, hw, a, rand)
                zeros = zeros or a.padding > 0
            elif name == "random_horizontal_flip":
                step = _flip(n, dev, a.p, rand)
            else:
                continue
            m = step if m is None else m @ step  # input <- (earlier steps) <- this step <- output
        return (None if m is None else m[:, :2, :]), zeros


def _affine(sx: torch.Tensor, sy: torch.Tensor, tx: torch.Tensor, ty: torch.Tensor) -> torch.Tensor:
    z, o = torch.zeros_like(sx), torch.ones_like(sx)
    return torch.stack([torch.stack([sx, z, tx], 1), torch.stack([z, sy, ty], 1), torch.stack([z, z, o], 1)], 1)


def _resized_crop(n: int, dev: torch.device, hw: tuple[int, int], a: Any, rand: Rand) -> tuple[torch.Tensor, tuple[int, int]]:
    h, w = hw
    u = rand(4)
    area = a.scale[0] + (a.scale[1] - a.scale[0]) * u[:, 0]
    lo, hi = math.log(a.ratio[0]), math.log(a.ratio[1])
    ratio = torch.exp(lo + (hi - lo) * u[:, 1])
    fw = torch.sqrt(area * ratio * h / w).clamp(max=1.0)  # crop width as a fraction of the image's
    fh = torch.sqrt(area / ratio * w / h).clamp(max=1.0)
    cx = (2 * u[:, 2] - 1) * (1 - fw)
    cy = (2 * u[:, 3] - 1) * (1 - fh)
    return _affine(fw, fh, cx, cy), _hw(a.size, hw)


def _crop(n: int, dev: torch.device, hw: tuple[int, int], a: Any, rand: Rand) -> tuple[torch.Tensor, tuple[int, int]]:
    h, w = hw
    oh, ow = _hw(a.size, hw)
    p = a.padding
    u = rand(2)
    ox = torch.floor(u[:, 0] * (w + 2 * p - ow + 1)).clamp(max=w + 2 * p - ow)  # whole-pixel offsets: exact samples
    oy = torch.floor(u[:, 1] * (h + 2 * p - oh + 1)).clamp(max=h + 2 * p - oh)
    one = torch.ones(n, device=dev)
    return _affine(one * (ow / w), one * (oh / h), (ow + 2 * (ox - p)) / w - 1, (oh + 2 * (oy - p)) / h - 1), (oh, ow)


def _flip(n: int, dev: torch.device, p: float, rand: Rand) -> torch.Tensor:
    sign = 1 - 2 * (rand() < p).float()
    one = torch.ones(n, device=dev)
    zero = torch.zeros(n, device=dev)
    return _affine(sign, one, zero, zero)


def _factor(n: int, amount: float, rand: Rand) -> torch.Tensor:
    lo = max(0.0, 1 - amount)
    return (lo + (1 + amount - lo) * rand()).view(n, 1, 1, 1)


def _jitter(x: torch.Tensor, a: Any, rand: Rand) -> torch.Tensor:
    n, c = x.shape[0], x.shape[1]
    if a.brightness > 0:
        x = (x * _factor(n, a.brightness, rand)).clamp(0, 1)
    if a.contrast > 0:
        gray = _gray(x).mean(dim=(1, 2, 3), keepdim=True)
        f = _factor(n, a.contrast, rand)
        x = (f * x + (1 - f) * gray).clamp(0, 1)
    if a.saturation > 0 and c == 3:
        f = _factor(n, a.saturation, rand)
        x = (f * x + (1 - f) * _gray(x)).clamp(0, 1)
    return x


def _gray(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] != 3:
        return x
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])


@dataclass
class Augmentation:
    """What the runner swaps in: the training transform, the evaluation one, the model's input shape."""

    train: DeviceAugment
    eval: ImageTransform
    input_shape: tuple[int, ...]
    params: dict[str, str]


def build(steps: Sequence[Any], transform: Any, sample_shape: tuple[int, ...]) -> Optional[Augmentation]:
    """The recipe's `augment:` list (checked `AugmentStep`s) for a dataset with this transform and raw sample shape."""
    if not steps:
        return None
    if len(sample_shape) != 3:
        raise AugmentError(f"augment: needs image samples (C, H, W); this dataset's samples have shape {tuple(sample_shape)}")
    if transform is not None and not isinstance(transform, ImageTransform):
        raise AugmentError(f"augment: needs a dataset whose transform is an mpsrun.ImageTransform (scale, normalise); this one has {type(transform).__name__}")
    base = transform or ImageTransform()
    c = sample_shape[0]
    in_hw = base._hw() or (int(sample_shape[1]), int(sample_shape[2]))
    parsed = [(s.name, s.args) for s in steps]
    mean, std = base.mean or (0.0,) * c, base.std or (1.0,) * c
    for name, a in parsed:
        if name == "normalize":
            mean, std = tuple(a.mean) if a.mean is not None else mean, tuple(a.std) if a.std is not None else std
            if len(mean) not in (1, c) or len(std) not in (1, c):
                raise AugmentError(f"augment: normalize needs 1 or {c} values for mean and std, got {len(mean)} and {len(std)}")
            if any(v <= 0 for v in std):
                raise AugmentError(f"augment: normalize's std must be positive, got {list(std)}")
        if name == "random_resized_crop" and not (0 < a.scale[0] <= a.scale[1] <= 1 and 0 < a.ratio[0] <= a.ratio[1]):
            raise AugmentError(f"augment: random_resized_crop needs 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1], got scale {a.scale}, ratio {a.ratio}")
    hw = in_hw
    for name, a in parsed:
        if name in ("random_resized_crop", "random_crop"):
            hw = _hw(a.size, hw)
            if min(hw) < 1:
                raise AugmentError(f"augment: {name} size must be positive, got {a.size}")
            if name == "random_crop" and (hw[0] > in_hw[0] + 2 * a.padding or hw[1] > in_hw[1] + 2 * a.padding):
                raise AugmentError(f"augment: random_crop size {list(hw)} is larger than the padded image")
    mean, std = tuple(float(v) for v in mean), tuple(float(v) for v in std)
    train = DeviceAugment(parsed, in_hw, hw, base.scale, mean, std, base.rgb)
    evaluate = dataclasses.replace(base, mean=mean, std=std, resize=None if hw == (sample_shape[1], sample_shape[2]) else hw)
    params = {f"augment.{i}": _describe(name, a) for i, (name, a) in enumerate(parsed)}
    return Augmentation(train, evaluate, evaluate.output_shape(tuple(sample_shape)), params)


def _describe(name: str, a: Any) -> str:
    fields = a.model_dump() if hasattr(a, "model_dump") else dict(vars(a))  # a recipe entry, or plain values (benchmarks)
    args = ", ".join(f"{k}={v}" for k, v in fields.items())
    return f"{name}({args})"
