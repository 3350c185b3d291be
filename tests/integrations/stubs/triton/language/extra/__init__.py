"""Test-only stand-in for ``triton.language.extra`` (see the stubs README)."""

from triton.language import _Placeholder

libdevice = _Placeholder()
