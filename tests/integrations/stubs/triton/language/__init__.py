"""Test-only stand-in for ``triton.language`` (see ../README.md)."""


class dtype:  # noqa: N801 - the name triton uses
    """Placeholder type: torch's dynamo lists triton.language.dtype among constant types."""



class _Placeholder:
    """Any triton.language name used at import time (annotations, constexpr values)."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __call__(self, *args, **kwargs):
        return _Placeholder(*args)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Placeholder,), {})
