"""mpsrun: honest, fast PyTorch experiments on MPS, CUDA and CPU, tracked in MLflow."""

from mpsrun.plugins.contract import DataSplits, ImageTransform

__version__ = "0.1.0"
__all__ = ["DataSplits", "ImageTransform", "__version__"]
