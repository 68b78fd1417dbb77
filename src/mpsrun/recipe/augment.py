"""The recipe's `augment:` list: each entry `{name: ..., <arguments>}`, checked before anything runs.

Why a model per augmentation rather than free keyword arguments: a misspelt name or argument
is caught by `mpsrun validate` with its position and a did-you-mean, like every other key;
the training loop (`mpsrun.train.loop.augment`) then builds device code from checked values.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mpsrun.recipe.problems import did_you_mean

Size = Union[int, list[int]]


class _Op(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RandomResizedCrop(_Op):
    """A random area (`scale`, of the image) and aspect ratio (`ratio`) per sample, resized to `size`."""

    size: Optional[Size] = Field(None, description="output side or [h, w]; default the cached image's size")
    scale: tuple[float, float] = Field((0.08, 1.0), description="range of the crop's area, as a fraction of the image")
    ratio: tuple[float, float] = Field((3 / 4, 4 / 3), description="range of the crop's width / height")


class RandomHorizontalFlip(_Op):
    p: float = Field(0.5, ge=0, le=1, description="probability that a sample is mirrored")


class RandomCrop(_Op):
    """A random `size` window per sample of the image padded by `padding` pixels (zeros)."""

    size: Optional[Size] = Field(None, description="output side or [h, w]; default the image's size")
    padding: int = Field(0, ge=0, description="pixels of zeros added on every side first")


class ColorJitter(_Op):
    """Per-sample factors drawn from [max(0, 1 - x), 1 + x] for each of brightness, contrast, saturation."""

    brightness: float = Field(0.0, ge=0, description="brightness factor spread (0: unchanged)")
    contrast: float = Field(0.0, ge=0, description="contrast factor spread (0: unchanged)")
    saturation: float = Field(0.0, ge=0, description="saturation factor spread (0: unchanged)")


class Normalize(_Op):
    """Mean and std per channel (values in [0, 1]); default the dataset's own. Validation uses the same."""

    mean: Optional[list[float]] = Field(None, description="per-channel mean; default the dataset's own, measured when the cache is built")
    std: Optional[list[float]] = Field(None, description="per-channel standard deviation; default the dataset's own")


OPS: dict[str, type[_Op]] = {
    "random_resized_crop": RandomResizedCrop,
    "random_horizontal_flip": RandomHorizontalFlip,
    "random_crop": RandomCrop,
    "color_jitter": ColorJitter,
    "normalize": Normalize,
}


class AugmentStep(BaseModel):
    """One entry of `augment:`: a known name plus that augmentation's arguments, flat beside it."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(..., description="one of the augmentations below; its arguments go flat beside it")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in OPS:
            raise PydanticCustomError("augment_name", "unknown augmentation '{name}'{hint}; known: {known}",
                                      {"name": v, "hint": did_you_mean(v, list(OPS)), "known": ", ".join(OPS)})
        return v

    @model_validator(mode="after")
    def _arguments(self) -> "AugmentStep":
        try:
            OPS[self.name](**(self.model_extra or {}))
        except ValidationError as e:
            fields = list(OPS[self.name].model_fields)
            msgs = []
            for err in e.errors():
                key = ".".join(str(x) for x in err["loc"])
                if err["type"] == "extra_forbidden":
                    msgs.append(f"unknown argument '{key}'{did_you_mean(key, fields)}; {self.name} takes {', '.join(fields)}")
                else:
                    msgs.append(f"{key}: {err['msg']} (found {err.get('input')!r})")
            raise PydanticCustomError("augment_args", "{name}: {msgs}", {"name": self.name, "msgs": "; ".join(msgs)})
        return self

    @property
    def args(self) -> Any:
        """The checked arguments as the augmentation's own model."""
        return OPS[self.name](**(self.model_extra or {}))
