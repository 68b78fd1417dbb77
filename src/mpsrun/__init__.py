"""mpsrun: honest, fast PyTorch experiments on MPS, CUDA and CPU, tracked in MLflow.

The names here are what plugin authors import (`from mpsrun import DataSplits, Callback`);
the modules behind them may move, these names stay.

`DataSplits`, `ImageTransform`, `Callback` and `RunState` are loaded on first use (PEP 562 module
`__getattr__`): their module imports torch, and every `mpsrun` command, `--help`
included, imports this package first; importing torch here cost 1.5 s before
any command could even print its help.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpsrun.plugins.contract import DataSplits, ImageTransform
    from mpsrun.train.controls.callbacks import Callback, RunState

__version__ = "0.1.0"
__all__ = ["Callback", "DataSplits", "ImageTransform", "RunState", "__version__"]

_LAZY = {
    "DataSplits": "mpsrun.plugins.contract",
    "ImageTransform": "mpsrun.plugins.contract",
    "Callback": "mpsrun.train.controls.callbacks",
    "RunState": "mpsrun.train.controls.callbacks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'mpsrun' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
