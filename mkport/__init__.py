"""mkport: port, validate and benchmark CUDA decode megakernels across model configs."""

__version__ = "0.1.0"
