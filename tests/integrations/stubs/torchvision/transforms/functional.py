"""Test-only stand-in for ``torchvision.transforms.functional`` (see ../../README.md)."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):
    """Any other function (``pil_to_tensor``, ...): importable, refuses to run."""
    if name.startswith("__"):
        raise AttributeError(name)

    def refuse(*args, **kwargs):
        raise RuntimeError(f"torchvision test stub: no transforms.functional.{name} here")

    refuse.__name__ = name
    return refuse
