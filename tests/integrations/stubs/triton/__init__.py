"""Test-only stand-in for ``triton`` (see ../README.md). Not a kernel compiler."""

__version__ = "0.0.0+kvshm-test-stub"


def jit(fn=None, **kwargs):
    """Return the function as is (decorator with or without arguments)."""
    if fn is None:
        return lambda f: f
    return fn


from . import language  # noqa: E402,F401
