"""The recipe's shape: Pydantic models whose field docs become the JSON Schema.

Also `key_problem`, which says whether a dotted path is one a matrix may vary: it
needs the models' fields, and keeping it here lets `overrides` and `matrix` import
the models without either importing the other.
"""

from __future__ import annotations

import re
import warnings
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mpsrun.recipe.augment import AugmentStep
from mpsrun.recipe.problems import did_you_mean

DEVICE_PATTERN = r"^(auto|cpu|mps|cuda(:\d+)?)$"
Auto = Literal["auto"]


class PluginSection(BaseModel):
    """A `name:` plus that plugin's keyword arguments, flat beside it."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(..., description="the plugin's name (distribution:name when two packages register it); its keyword arguments go flat beside it")

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


# `tracking.register` is the user-facing key; pydantic warns that it shadows ABCMeta's
# `register` classmethod on instances, which nothing here uses.
warnings.filterwarnings("ignore", message='Field name "register"', category=UserWarning)


class TrackingSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    experiment: str | None = Field(None, description="MLflow experiment; default: the recipe file's name")
    run_name: str | None = Field(None, description="the run's name; default <model>-<dataset>-<device>-<suffix>")
    tags: dict[str, str] = Field(default_factory=dict, description="extra tags set on the run (values are stored as strings)")
    log_model: bool = Field(True, description="log the trained model with mlflow.pytorch (artifact `model`: signature, input example, requirements)")
    register: str | None = Field(None, description="register the logged model as a new version of this registered model")
    system_metrics: bool = Field(True, description="sample CPU, memory, disk, network and GPU (NVIDIA, MPS) as system/... metrics")
    figures: bool = Field(True, description="draw the run's figures (learning curves, confusion matrix or predictions); `mpsrun sweep` trials default to false")

    @field_validator("tags", mode="before")
    @classmethod
    def _tags_as_strings(cls, v: Any) -> Any:
        # YAML turns `seed: 1` into an int; MLflow tags are strings anyway.
        if isinstance(v, dict):
            return {str(k): str(val) for k, val in v.items()}
        return v


class LoaderSection(BaseModel):
    """Options for the DataLoader path, used when data is not device-resident."""

    model_config = ConfigDict(extra="forbid")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes (0: batches made in the training process)")
    persistent_workers: bool = Field(True, description="keep the workers alive between epochs (with num_workers > 0)")
    pin_memory: Union[Auto, bool] = Field("auto", description="pinned host memory for faster copies (auto: on for CUDA only)")


class CheckpointSection(BaseModel):
    """End-of-epoch checkpoints, kept with the run (its artifacts) so `mpsrun resume` continues it."""

    model_config = ConfigDict(extra="forbid")
    every: int = Field(1, ge=0, description="epochs between checkpoints (0: off; `mpsrun bench` cells default to 0)")
    keep: int = Field(1, ge=1, description="recent epoch checkpoints kept (the newest is always checkpoints/last.pt)")
    monitor: str = Field("val_loss", description="metric that picks the best checkpoint (checkpoints/best.pt)")
    mode: Literal["min", "max"] = Field("min", description="whether a lower (min) or higher (max) monitor is better")


class SchedulerSection(PluginSection):
    """`name:` a torch.optim.lr_scheduler class, its keyword arguments flat beside it, plus how to step it."""

    interval: Literal["epoch", "step"] = Field("epoch", description="step the schedule after each epoch or each optimizer step")
    warmup_epochs: int = Field(0, ge=0, description="linear warm-up epochs before the schedule (LinearLR + SequentialLR)")
    warmup_start_factor: float = Field(0.1, gt=0, le=1, description="warm-up starts at this fraction of the learning rate")
    monitor: str = Field("val_loss", description="metric fed to ReduceLROnPlateau (ignored by other schedules)")


class EarlyStoppingSection(BaseModel):
    """Stop when the monitored metric has not improved for `patience` epochs."""

    model_config = ConfigDict(extra="forbid")
    monitor: str = Field("val_loss", description="a metric every epoch logs: val_loss, val_accuracy, val_r2, val_mae, train_loss, ...")
    mode: Literal["min", "max"] = Field("min", description="min: lower is better (losses, errors); max: higher is (accuracy, r2)")
    patience: int = Field(3, ge=1, description="epochs without improvement before the run stops (FINISHED, tagged mpsrun.stopped_early)")
    min_delta: float = Field(0.0, ge=0, description="a change must beat the best by more than this to count as an improvement")


class GradClipSection(BaseModel):
    """Clip the gradients' global norm inside the step; the epoch's largest pre-clip norm is logged as grad_norm."""

    model_config = ConfigDict(extra="forbid")
    max_norm: float = Field(..., gt=0, description="largest global gradient norm; larger gradients are scaled down to it")
    norm_type: float = Field(2.0, gt=0, description="p of the p-norm (2: Euclidean)")


def _matrix_key(key: str) -> str:
    """A matrix key must be a recipe path a cell can set (see `key_problem`)."""
    problem = key_problem(key)
    if problem:
        raise PydanticCustomError("matrix_key", problem)
    return key


MatrixKey = Annotated[str, AfterValidator(_matrix_key)]


# Metric names whose better direction is known: a sweep's `mode` defaults from them.
LOWER_IS_BETTER = ("loss", "mae", "rmse", "mse", "time_s", "grad_norm")
HIGHER_IS_BETTER = ("accuracy", "r2", "samples_per_s")
SAMPLERS = ("tpe", "random", "grid", "cmaes", "qmc")
PRUNERS = ("none", "median", "hyperband", "successive_halving")


def metric_mode(metric: str) -> Literal["min", "max"] | None:
    """min for losses and errors, max for accuracy and r2; None when the name does not say."""
    if metric.endswith(LOWER_IS_BETTER):
        return "min"
    if metric.endswith(HIGHER_IS_BETTER):
        return "max"
    return None


def _choices(v: Any) -> Any:
    """`optimizer.name: [sgd, adam]` is a choice list; a mapping is a range."""
    return {"choices": v} if isinstance(v, list) else v


class SweepParam(BaseModel):
    """One searched path: `choices` (written as a plain list), or a range `low`..`high` (`step`, `log`).

    Integer bounds (and step) make an integer range; any float makes a float range.
    """

    model_config = ConfigDict(extra="forbid")
    choices: list[Any] | None = Field(None, description="values to choose from (written as a plain list)")
    low: Union[int, float, None] = Field(None, description="lower end of a range (integers: an integer range)")
    high: Union[int, float, None] = Field(None, description="upper end of a range, included")
    step: Union[int, float, None] = Field(None, gt=0, description="spacing of a discrete range (needed by the grid sampler)")
    log: bool = Field(False, description="sample the range on a log scale (low above 0, no step)")

    @model_validator(mode="after")
    def _coherent(self) -> "SweepParam":
        if self.choices is not None:
            if not self.choices:
                raise PydanticCustomError("sweep_choices", "an empty choice list: give at least one value")
            if self.low is not None or self.high is not None or self.step is not None or self.log:
                raise PydanticCustomError("sweep_param", "either a choice list or a range (low, high), not both")
            return self
        if self.low is None or self.high is None:
            raise PydanticCustomError("sweep_range", "a range needs both low and high (or write a list of choices)")
        if self.low > self.high:
            raise PydanticCustomError("sweep_range", "low {low} is above high {high}", {"low": self.low, "high": self.high})
        if self.log and self.low <= 0:
            raise PydanticCustomError("sweep_range", "a log range must start above 0, not at {low}", {"low": self.low})
        if self.log and self.step is not None:
            raise PydanticCustomError("sweep_range", "log and step do not go together (Optuna samples a log range continuously)")
        return self

    @property
    def is_int(self) -> bool:
        return self.choices is None and all(isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high, self.step) if v is not None)

    def candidates(self) -> list[Any]:
        """Values worth checking against the recipe before anything runs: every choice, or both ends."""
        return list(self.choices) if self.choices is not None else [self.low, self.high]


def _sweep_key(key: str) -> str:
    problem = key_problem(key)
    if key in SPECIAL or key.split(".")[0] in ("sweep", "tracking", "device_fallback"):
        problem = problem or f"'{key.split('.')[0]}' cannot be searched"
    if problem:
        raise PydanticCustomError("sweep_key", problem.replace("inside a matrix", "in a sweep"))
    return key


SweepKey = Annotated[str, AfterValidator(_sweep_key)]
SweepValue = Annotated[
    SweepParam,
    BeforeValidator(_choices),
    WithJsonSchema({"anyOf": [{"type": "array", "minItems": 1}, {"type": "object", "properties": {
        "low": {"type": "number"}, "high": {"type": "number"}, "step": {"type": "number"}, "log": {"type": "boolean"}},
        "additionalProperties": False}]}),
]


class SweepSection(BaseModel):
    """What `mpsrun sweep` searches (Optuna); `mpsrun run` ignores this section and trains the recipe's own values."""

    model_config = ConfigDict(extra="forbid")
    metric: str = Field("val_loss", description="a metric every epoch logs; a trial's value is its last epoch's")
    mode: Union[Literal["min", "max"], None] = Field(None, description="min or max; default from the metric's name (min for loss/mae/rmse, max for accuracy/r2)")
    trials: int = Field(20, ge=1, description="finished trials (COMPLETE, PRUNED or FAILED by their own doing) the study holds when the sweep ends")
    sampler: Literal["tpe", "random", "grid", "cmaes", "qmc"] = Field("tpe", description="Optuna sampler, seeded from the recipe's seed")
    pruner: Literal["none", "median", "hyperband", "successive_halving"] = Field("none", description="Optuna pruner; the metric is reported every epoch")
    params: dict[SweepKey, SweepValue] = Field(..., min_length=1, description="dotted recipe path -> [choices] or {low, high, step, log}")
    fuse: Union[Literal["auto", "off"], Annotated[int, Field(ge=1)]] = Field(
        "auto", description="train trials that differ only in values (lr, weight decay, momentum, betas, seed, dropout, label smoothing) "
        "together as one fused step: auto (groups sized from the device's free memory), off, or the largest group")

    def direction(self) -> Literal["min", "max"] | None:
        """`mode`, else what the metric's name says (None: it does not say; the sweep asks for `mode:`)."""
        return self.mode or metric_mode(self.metric)


class Recipe(BaseModel):
    """The validated recipe. Field docs become the JSON Schema's descriptions."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field("auto", pattern=DEVICE_PATTERN, description="auto, cpu, mps, cuda or cuda:N")
    device_fallback: list[str] = Field(
        default_factory=list, description="devices to try, in order, when `device` is unusable"
    )
    epochs: int = Field(1, ge=1, description="passes over the training data")
    batch_size: int = Field(64, ge=1, description="samples per step; with several ranks (--nproc) the global batch, shared between them")
    seed: int = Field(0, description="seeds weights, data order, splits and augmentation: the same seed trains the same run")
    dataset: PluginSection = Field(..., description="a dataset plugin by name (digits, mnist, fashion_mnist, image_folder, ...) and its arguments")
    model: PluginSection = Field(..., description="a model plugin by name (mlp, cnn, torchvision, ...) and its arguments; num_classes and input_shape are filled in")
    optimizer: PluginSection = Field(..., description="a torch.optim optimizer by lower-case name (sgd, adam, adamw, ...) and its arguments")
    tracking: TrackingSection = Field(default_factory=TrackingSection, description="where and how the run is recorded in MLflow")
    loader: LoaderSection = Field(default_factory=LoaderSection, description="the DataLoader path, for data that is not device-resident")

    # Training controls (train/assemble.py): all optional; the defaults follow the dataset's task.
    loss: Union[PluginSection, None] = Field(None, description="a torch.nn loss by snake_case name (mse, cross_entropy, ...) or an mpsrun.losses plugin, with its arguments")
    metrics: list[str] = Field(default_factory=list, description="metrics beside the task's defaults (top5_accuracy, mse, mae, rmse, r2, accuracy)")
    scheduler: Union[SchedulerSection, None] = Field(None, description="a torch.optim.lr_scheduler class by name (CosineAnnealingLR), its arguments, interval, warmup_epochs")
    early_stopping: Union[EarlyStoppingSection, None] = Field(None, description="stop when the monitored metric stops improving")
    grad_clip: Union[GradClipSection, None] = Field(None, description="clip the gradients' global norm inside the step")
    accumulate: int = Field(1, ge=1, description="micro-batches per optimizer step; exact: batch_size 16 x 4 trains like 64")
    callbacks: list[PluginSection] = Field(default_factory=list, description="mpsrun.callbacks plugins, each {name: ..., <kwargs>}, called between epochs in this order")
    augment: list[AugmentStep] = Field(default_factory=list, description="training-image augmentations run per sample on the device, in order: "
                                       "random_resized_crop, random_horizontal_flip, random_crop, color_jitter, normalize; validation only resizes and normalizes")

    # Speed options: each `auto` is resolved per device by the engine and recorded.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto", description="auto (fp32), fp32, bf16 (autocast) or fp16 (autocast + grad scaler, no CUDA graphs)")
    channels_last: Union[Auto, bool] = Field("auto", description="channels_last memory format (auto: on for conv models on CUDA)")
    compile: Union[Auto, bool] = Field("auto", description="torch.compile the model (auto: off); a failure falls back to eager, said and tagged")
    graphs: Union[Auto, bool] = Field("auto", description="CUDA graphs around the whole step")
    cudnn_benchmark: Union[Auto, bool] = Field(
        "auto", description="let cuDNN time its convolution algorithms (auto: on for conv models on CUDA)"
    )
    resident: Union[Auto, bool] = Field(
        "auto", description="keep the dataset on the device when it fits"
    )
    resident_max_gb: Union[Auto, Annotated[float, Field(gt=0)]] = Field(
        "auto", description="largest dataset (GiB) copied onto the device; auto: what fits beside the model (CUDA: after a measured step)"
    )
    log_every: int = Field(
        0, ge=0, description="steps between progress reads of the loss (0: once per epoch)"
    )
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description="end-of-epoch checkpoints kept with the run, for mpsrun resume")
    on_nonfinite: Literal["stop", "warn"] = Field(
        "stop", description="a NaN or infinite loss read at an epoch end: stop (run FAILED, exit 1) or warn and go on"
    )
    model_from: Literal["best", "last"] = Field(
        "best", description="weights logged and evaluated at the end: the best checkpoint's (by checkpoint.monitor) or the last epoch's"
    )
    canary: Literal["on", "warn", "off"] = Field(
        "on",
        description="start-up check of known-fragile ops on the device against the CPU: "
        "on (stop on a mismatch), warn (warn and go on), off",
    )

    # Benchmarks (`mpsrun bench`): one child run per combination and repeat.
    matrix: dict[MatrixKey, Annotated[list[Any], Field(min_length=1)]] = Field(
        default_factory=dict,
        description="dotted recipe path -> values to try (device, batch_size, model.arch, ...); "
        "`include`/`exclude`: lists of {path: value} as in GitHub Actions matrices",
    )
    repeats: int = Field(1, ge=1, description="runs of each matrix cell; the table reports medians and spread")

    # Searches (`mpsrun sweep`): Optuna trials, each a child run; `mpsrun run` ignores the section.
    sweep: Union[SweepSection, None] = Field(None, description="what mpsrun sweep searches (Optuna); mpsrun run ignores it")

    @field_validator("device_fallback", mode="before")
    @classmethod
    def _fallback_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("device_fallback")
    @classmethod
    def _fallback_names(cls, v: list[str]) -> list[str]:
        for d in v:
            if not re.match(DEVICE_PATTERN, d):
                raise ValueError(f"'{d}' is not a device (expected auto, cpu, mps, cuda or cuda:N)")
        return v


SPECIAL = ("include", "exclude")
_NOT_AXES = ("matrix", "repeats", "sweep")


def key_problem(key: str) -> str | None:
    """Why `key` is not a recipe path a matrix may vary, or None when it is one."""
    if key in SPECIAL:
        return None
    parts = key.split(".")
    if any(not p for p in parts):
        return "not a dotted recipe path such as optimizer.lr"
    top = parts[0]
    fields = [f for f in Recipe.model_fields if f not in _NOT_AXES]
    if top in _NOT_AXES:
        return f"'{top}' cannot vary inside a matrix"
    if top not in Recipe.model_fields:
        return f"unknown recipe path{did_you_mean(top, fields + list(SPECIAL))}"
    ann = Recipe.model_fields[top].annotation
    if ann is TrackingSection:
        return "tracking settings cannot vary: every cell is a child run of one parent, in one experiment"
    if len(parts) == 1 or ann is PluginSection or top in ("loss", "scheduler", "early_stopping", "grad_clip"):
        return None  # plugin arguments are checked against the plugin's signature, per cell
    if ann in (LoaderSection, CheckpointSection):
        sub = list(ann.model_fields)
        if parts[1] not in sub:
            return f"unknown recipe path{did_you_mean(parts[1], sub)}; {top} keys: {', '.join(sub)}"
        return None if len(parts) == 2 else f"'{top}.{parts[1]}' is a value, not a section"
    return f"'{top}' is a value, not a section"
