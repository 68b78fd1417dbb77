"""The plugin contract: what a dataset plugin returns.

Kept tiny and free of runner internals so a plugin package depends on nothing
but `mpsrun.DataSplits` (and, optionally, `mpsrun.ImageTransform`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.utils.data import Dataset


@dataclass
class DataSplits:
    """A dataset plugin's result.

    Attributes:
        train: a `torch.utils.data.Dataset` yielding (input, label). When it is a
            `torch.utils.data.TensorDataset` (raw tensors: uint8 images, int64 labels),
            the runner may copy it to the device once and batch there (the fast path).
        val: the validation split, the same kind of dataset as `train`.
        num_classes: the model plugin's output width (labels are 0 .. num_classes - 1).
        input_shape: the shape of one sample *after* `transform`; the model plugin is given it.
        transform: optional, applied by the runner to each input batch *on the device*
            (scaling, normalising, resizing), so raw tensors can stay small.
        info: optional facts a model may need beyond num_classes and input_shape (the
            tabular dataset's column cardinalities, say); the runner passes it to a
            model plugin that declares a `data_info` parameter. Keep it JSON-friendly.
            A regression dataset that standardised its target puts `target_mean` and
            `target_std` here, and metrics are reported in the target's own units.
            Two keys the runner reads itself: `notes` (a list of strings, said on screen
            and tagged `mpsrun.notes`: fallbacks, skipped files) and `tags` (a dict of
            string tags set on the run, e.g. `mpsrun.data.cache: built`); `classes`
            names the classes (figures, the logged model's metadata); `source` (a
            path) is the folder or file read, recorded as the MLflow dataset's source.
        task: "classification" (int64 labels, num_classes of them) or "regression"
            (float targets (N,) or (N, k); num_classes is 0). The runner fills a
            model's `num_outputs` with num_classes or k, and picks the default loss
            (cross_entropy or mse) and metrics from it.
        test: optional held-out split, evaluated once after training with the weights
            the run logs (`test_loss`, `test_accuracy` or the regression metrics).
    """

    train: Dataset
    val: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
    transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    info: dict[str, Any] = field(default_factory=dict)
    task: str = "classification"
    test: Optional[Dataset] = None


@dataclass(frozen=True)
class ImageTransform:
    """Batch-wise image preprocessing that runs on the device.

    Doing it per batch on the accelerator replaces per-sample PIL/ToTensor work on
    the CPU, which is what makes hand-written loops slow. Picklable, so the
    DataLoader path works with the spawn start method too. Batches that are not
    images ((N, F), (N, C, L)) are scaled and normalised along dimension 1 and keep
    their shape; `resize` and `rgb` need (N, C, H, W).
    """

    scale: float = 1.0 / 255.0
    mean: Optional[tuple[float, ...]] = None
    std: Optional[tuple[float, ...]] = None
    resize: Optional[int | tuple[int, int]] = None  # a square side, or (height, width)
    rgb: bool = False

    # Per-device (and per batch rank) affine coefficients, built on the first call (outside
    # any CUDA graph capture, which forbids host-to-device copies) and reused after.
    _affine: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _coefficients(self, device: torch.device, ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Shaped to broadcast over dimension 1 (channels) of a batch of `ndim` dimensions.

        Not a fixed (1, C, 1, 1): a batch of 1-D samples (N, F), e.g. the synthetic dataset's
        `shape: [8]` in uint8, would otherwise broadcast to (1, 1, N, F) and lose its batch axis.
        """
        key = (str(device), ndim)
        if key not in self._affine:
            mean = torch.tensor(self.mean if self.mean is not None else (0.0,))
            std = torch.tensor(self.std if self.std is not None else (1.0,))
            view = (1, -1) + (1,) * max(ndim - 2, 0)
            a = (self.scale / std).view(view)  # x * scale, then (x - mean) / std, as one affine
            b = (-mean / std).view(view)
            self._affine[key] = (a.to(device), b.to(device))
        return self._affine[key]

    def _hw(self) -> tuple[int, int] | None:
        if self.resize is None:
            return None
        if isinstance(self.resize, int):
            return (self.resize, self.resize)
        return (int(self.resize[0]), int(self.resize[1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self._coefficients(x.device, x.dim())
        # On CUDA the uint8 batch goes into addcmul as it is (promoted inside the kernel, the same
        # values): one kernel fewer per step. Elsewhere (MPS's mixed-dtype kernels) it is cast first.
        x = torch.addcmul(b, x if x.is_cuda else x.float(), a)
        if x.dim() != 4:  # not images: scaling and normalising only
            if self.resize is not None or self.rgb:
                raise ValueError(f"ImageTransform: resize and rgb need image batches (N, C, H, W), got shape {tuple(x.shape)}")
            return x
        hw = self._hw()
        if hw is not None and tuple(x.shape[-2:]) != hw:
            x = torch.nn.functional.interpolate(x, size=hw, mode="bilinear", align_corners=False)
        if self.rgb and x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        return x

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) != 3:  # not an image: scaling keeps the shape
            if self.resize is not None or self.rgb:
                raise ValueError(f"ImageTransform: resize and rgb need image samples (C, H, W), got shape {tuple(shape)}")
            return tuple(shape)
        c, h, w = shape
        hw = self._hw()
        if hw is not None:
            h, w = hw
        if self.rgb and c == 1:
            c = 3
        return (c, h, w)
