"""Test-only stand-in for ``torchvision`` (see ../README.md). Runs no image op."""

__version__ = "0.0.0+kvshm-test-stub"
