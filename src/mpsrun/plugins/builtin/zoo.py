"""Built-in model plugin `torchvision`: any torchvision classification model, by name.

The published "Mac GPU vs CPU" comparisons train stock torchvision models, so the
zoo benchmark needs them as they are: built by `torchvision.models.get_model`,
with only the two changes a different dataset forces (the classifier head sized
to the dataset's classes, the first convolution sized to its channels), and with
pretrained weights only from the local cache: a benchmark must not depend on, or
silently time, a download.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from typing import Any, Optional
from urllib.parse import urlparse

import torch
from pydantic_core import PydanticCustomError, core_schema
from torch import nn

from mpsrun.plugins.registry import PluginError
from mpsrun.recipe.problems import did_you_mean


@lru_cache(maxsize=1)
def classification_models() -> tuple[str, ...]:
    """Names torchvision registers as classification models (not detection, video, ...)."""
    import torchvision.models

    return tuple(torchvision.models.list_models(module=torchvision.models))


def _check_arch(name: str) -> str:
    names = classification_models()
    if name not in names:
        raise PydanticCustomError(
            "arch",
            "unknown torchvision classification model '{name}'{hint}; see torchvision.models.list_models()",
            {"name": name, "hint": did_you_mean(name, names)},
        )
    return name


class Arch(str):
    """A torchvision classification model name, checked when the recipe is validated."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(_check_arch, core_schema.str_schema())


def _weights(arch: str, name: str) -> Any:
    """Resolve 'DEFAULT', 'IMAGENET1K_V1' or 'ResNet18_Weights.IMAGENET1K_V1' for `arch`."""
    from torchvision.models import get_model_weights

    enum = get_model_weights(arch)
    short = name.split(".", 1)[1] if name.startswith(enum.__name__ + ".") else name
    choices = [w.name for w in enum] + ["DEFAULT"]
    if short not in choices:
        raise PluginError(f"model.weights: '{name}' is not a weights name of {arch}{did_you_mean(short, choices)}; available: {', '.join(choices)}")
    return enum[short] if short != "DEFAULT" else enum.DEFAULT


def cached_weights_path(weights: Any) -> str:
    """Where torch.hub keeps the file of `weights` (TORCH_HOME/hub/checkpoints/<file>)."""
    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlparse(weights.url).path))


def _replace(model: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, attr = dotted.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def _adapt_head(model: nn.Module, num_classes: int, trained_classes: int) -> None:
    """Swap the last layer that produces the pretrained class scores for a fresh one."""
    last = None
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and m.out_features == trained_classes:
            last = (name, m)
        elif isinstance(m, nn.Conv2d) and m.out_channels == trained_classes:  # squeezenet's head
            last = (name, m)
    if last is None:
        raise PluginError(f"cannot find the classifier layer ({trained_classes} outputs) to resize to {num_classes} classes")
    name, m = last
    if isinstance(m, nn.Linear):
        new: nn.Module = nn.Linear(m.in_features, num_classes, bias=m.bias is not None)
    else:
        new = nn.Conv2d(m.in_channels, num_classes, m.kernel_size, m.stride, m.padding, bias=m.bias is not None)  # type: ignore[arg-type]
    _replace(model, name, new)


def _adapt_first_conv(model: nn.Module, channels: int) -> None:
    """Give the stem convolution `channels` inputs; pretrained RGB kernels are summed or tiled (timm's rule)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d) and m.in_channels == 3:
            new = nn.Conv2d(
                channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation, m.groups,  # type: ignore[arg-type]
                bias=m.bias is not None, padding_mode=m.padding_mode,
            )
            with torch.no_grad():
                w = m.weight
                if channels == 1:
                    new.weight.copy_(w.sum(dim=1, keepdim=True))
                else:
                    reps = -(-channels // 3)
                    new.weight.copy_(w.repeat(1, reps, 1, 1)[:, :channels] * (3 / channels))
                if m.bias is not None:
                    new.bias.copy_(m.bias)
            _replace(model, name, new)
            return
    raise PluginError(f"cannot find a 3-channel first convolution to adapt to {channels} channels; use dataset.rgb: true")


class WeightsNorm(nn.Module):
    """The pretrained weights' own input normalisation, in front of the network.

    The dataset hands the model its images normalised with the data set's own mean and std (its
    transform, which the runner applies on the device and logs with the model); the pretrained
    weights learnt on images normalised with theirs (`weights.transforms()`). This layer maps the one
    to the other exactly, one multiply-add per pixel: x_weights = x_data * (std_data / std_w) +
    (mean_data - mean_w) / std_w. Being part of the model, it is in every checkpoint and in the logged
    model, so `mpsrun eval` and a served model apply it with no step of their own.
    """

    def __init__(self, data_mean: list[float], data_std: list[float], mean: list[float], std: list[float]) -> None:
        super().__init__()
        dm, ds, m, sd = (torch.tensor([float(v) for v in t]) for t in (data_mean, data_std, mean, std))
        self.register_buffer("scale", (ds / sd).view(1, -1, 1, 1))
        self.register_buffer("shift", ((dm - m) / sd).view(1, -1, 1, 1))
        self.mean, self.std = list(mean), list(std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift.to(x.dtype), x, self.scale.to(x.dtype))

    def extra_repr(self) -> str:
        return f"mean={self.mean}, std={self.std}"


class Pretrained(nn.Module):
    """A torchvision network with its pretrained weights' input normalisation (`norm`) in front."""

    def __init__(self, norm: WeightsNorm, net: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.norm(x))


def _say(data_info: Optional[dict[str, Any]], note: str) -> None:
    """A note for the run (said on screen, tagged): the dataset's notes list, which the runner reads after the model is built."""
    notes = data_info.get("notes") if isinstance(data_info, dict) else None
    if isinstance(notes, list):
        if note not in notes:  # a sweep worker's trials share one dataset: said once
            notes.append(note)
    else:  # a dataset without a notes list: on screen at least
        print(f"note: {note}", file=sys.stderr, flush=True)


def _with_weights_norm(model: nn.Module, w: Any, channels: int, input_shape: tuple[int, ...], num_classes: int,
                       data_info: Optional[dict[str, Any]]) -> nn.Module:
    """Fine-tuning: the weights' normalisation in front (where the dataset says its own), and what the run is told."""
    t = w.transforms()
    mean, std = list(getattr(t, "mean", []) or []), list(getattr(t, "std", []) or [])
    crop, resize = list(getattr(t, "crop_size", []) or []), list(getattr(t, "resize_size", []) or [])
    trained = f"{w} were trained on {crop[0] if crop else '?'} px crops" + (f" (resized to {resize[0]}, centre-cropped)" if resize else "")
    fed = "x".join(str(v) for v in input_shape)
    head = f"head replaced: {len(w.meta['categories'])} -> {num_classes} classes"
    info = data_info or {}
    dm, ds = info.get("mean"), info.get("std")
    if channels == 3 and len(mean) == 3 and isinstance(dm, list) and isinstance(ds, list) and len(dm) == len(ds) == 3:
        _say(data_info, f"model: {trained}; this run feeds {fed}; inputs normalised with the weights' mean {mean} and std {std} "
                        f"(the data set's own undone in the model's first layer, logged with it); {head}")
        return Pretrained(WeightsNorm(dm, ds, mean, std), model)
    why = "the dataset does not say its mean and std" if channels == 3 else f"{channels}-channel input"
    _say(data_info, f"model: {trained}; this run feeds {fed}; inputs reach the weights as the dataset normalises them, "
                    f"not with the weights' mean {mean} and std {std} ({why}); {head}")
    return model


def _check_input(build: Any, arch: str, input_shape: tuple[int, ...]) -> None:
    """Fail at setup, with what to change, when `arch` cannot take inputs of this shape.

    Traced on the meta device (no memory, no arithmetic); only if that trace fails
    is a real one-sample CPU forward tried, so a meta-unsupported op cannot reject
    a model that works.
    """
    x_shape = (2, *input_shape)
    try:
        with torch.device("meta"):
            m = build()
            m.eval()
            with torch.no_grad():
                m(torch.empty(x_shape))
        return
    except Exception:
        pass
    try:
        m = build()
        m.eval()
        with torch.no_grad():
            m(torch.zeros(x_shape))
    except Exception as e:
        hint = "resize the images (dataset.resize: 224)" if input_shape[-1] < 224 else "use the size this model expects"
        raise PluginError(
            f"torchvision model '{arch}' cannot take inputs of shape {tuple(input_shape)} "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); {hint}"
        ) from None


def torchvision_model(
    arch: Arch,
    num_classes: int,
    input_shape: tuple[int, ...],
    weights: Optional[str] = None,
    data_info: Optional[dict[str, Any]] = None,
) -> nn.Module:
    """Any torchvision classification model by name (arch: resnet18, vgg16, efficientnet_b0, ...).

    weights: null trains from scratch; a weights name (DEFAULT, IMAGENET1K_V1 or
    ResNet18_Weights.IMAGENET1K_V1) is used only when its file is already in the
    torch hub cache (nothing is downloaded). The classifier head is sized to the
    dataset's classes (built that way when training from scratch, replaced after
    loading pretrained weights). Inputs without 3 channels get a first convolution
    with that many inputs (pretrained kernels summed for 1 channel); to keep the
    stock stem instead, set dataset.rgb: true. Vision transformers are built for the
    input's image size. With weights, the model normalises its inputs as the weights were
    trained (`weights.transforms()`'s mean and std, in place of the dataset's: a first layer
    that is logged with the model, so eval and serving apply it too), and the run is told the
    size the weights were trained at. List the names with
    `python -c "import torchvision; print(torchvision.models.list_models(module=torchvision.models))"`.
    """
    from torchvision.models import get_model

    arch = str(arch)
    if arch not in classification_models():  # called directly, without recipe validation
        raise PluginError(f"unknown torchvision classification model '{arch}'{did_you_mean(arch, classification_models())}")
    channels, size = input_shape[0], input_shape[-1]
    kwargs: dict[str, Any] = {}
    w = None
    if weights is not None:
        w = _weights(arch, weights)
        path = cached_weights_path(w)
        if not os.path.exists(path):
            raise PluginError(
                f"model.weights: {w} are not in the local cache and mpsrun does not download weights; place the file "
                f"{os.path.basename(path)} ({w.url}) at {path}: fetch it once where there is internet (python -c \"import torchvision; "
                f"torchvision.models.get_model('{arch}', weights='{w}')\") and copy it there, "
                f"or point TORCH_HOME at a cache that has it; or use weights: null"
            )
    else:
        if arch.startswith("vit_"):
            kwargs["image_size"] = size
        elif arch.startswith("maxvit_"):
            kwargs["input_size"] = (input_shape[-2], size)
        if arch in ("googlenet", "inception_v3"):
            kwargs["aux_logits"] = False  # one tensor of logits in training, like every other model
    if arch in ("googlenet", "inception_v3") and channels != 3:
        kwargs["transform_input"] = False  # that transform assumes ImageNet RGB

    def build(load: bool = False) -> nn.Module:
        if load:
            model = get_model(arch, weights=w, **kwargs)
            _adapt_head(model, num_classes, len(w.meta["categories"]))
        else:
            model = get_model(arch, weights=None, num_classes=num_classes, **kwargs)
        if channels != 3:
            _adapt_first_conv(model, channels)
        return model

    _check_input(build, arch, tuple(input_shape))
    try:
        model = build(load=w is not None)
        return model if w is None else _with_weights_norm(model, w, channels, tuple(input_shape), num_classes, data_info)
    except PluginError:
        raise
    except Exception as e:  # a corrupt or mismatched cached file
        raise PluginError(f"cannot build torchvision model '{arch}' with weights {w}: {type(e).__name__}: {e}") from None


__all__ = ["torchvision_model", "classification_models", "cached_weights_path", "Arch", "Pretrained", "WeightsNorm"]
