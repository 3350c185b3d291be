"""Test-only stand-in for ``triton.language`` (see ../README.md)."""


class dtype:  # noqa: N801 - the name triton uses
    """Placeholder type: torch's dynamo lists triton.language.dtype among constant types."""
