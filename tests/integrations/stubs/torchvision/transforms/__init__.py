"""Test-only stand-in for ``torchvision.transforms`` (see ../../README.md)."""

from .functional import InterpolationMode  # noqa: F401


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {"__init__": _refuse})


def _refuse(self, *args, **kwargs):
    raise RuntimeError("torchvision test stub: no image transforms here")
