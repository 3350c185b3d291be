"""break18: engine keys' escaped fields (kvshm.integrations._common.key_field, LMCache's
chunk_field / prefix_field): injective, searched exhaustively over small alphabets of the
separators and escapes (no hypothesis in the engine venv), and today's keys byte for byte
where no separator is present."""

from __future__ import annotations

import itertools
from urllib.parse import unquote

import pytest

import _engines  # noqa: F401  (engine venv checks)

from kvshm.integrations._common import ESCAPED, key_field

ALPHA = ["a", "|", "%", "~", "2", "5", "/", "é"]


def _strings(alpha: list[str], n: int) -> list[str]:
    return ["".join(p) for k in range(n + 1) for p in itertools.product(alpha, repeat=k)]


def test_key_field_injective_with_a_left_inverse() -> None:
    """(held) key_field over every string of up to 3 of ``a | % ~ 2 5 / é``: none holds
    ``|``, an unescaped one is its input and never starts with ``%~``, an escaped one
    unquotes back to its input; so fields joined with ``|`` split back (injective)."""
    seen: dict[str, str] = {}
    for s in _strings(ALPHA, 3):
        f = key_field(s)
        assert "|" not in f
        if f.startswith(ESCAPED):
            assert unquote(f[len(ESCAPED):]) == s
        else:
            assert f == s and "|" not in s
        assert seen.setdefault(f, s) == s, (f, s, seen[f])
    for s in ("lmc/", "kvshm", "bfloat16", "float16", "nhd", "a%b", "x~y", "%h"):
        assert key_field(s) == s          # today's fields byte for byte


lmc = pytest.importorskip("kvshm.integrations.lmcache")


def _ck(model: str, tags: list[tuple[str, str]]):
    import torch
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(model, 1, 0, 0x5EED, torch.bfloat16,
                          {f"lmcache.tag.{k}": v for k, v in tags})


def test_lmcache_tag_name_escaped_value_with_percent_never_meet() -> None:
    """Tag ``a@`` = ``25%`` and tag ``a@%`` = ``""``: the escaped tag name's own
    percent-escapes met the ``%`` that ends it (``%~a%40`` + ``%`` + ``25%`` was
    ``%~a%40%25`` + ``%`` + ``""``), one key for two chunks (before the fix)."""
    k1 = _ck("m", [("a@", "25%")])
    k2 = _ck("m", [("a@%", "")])
    assert lmc.chunk_field(k1) != lmc.chunk_field(k2)
    k3 = _ck("m", [("a@", "25%y")])
    k4 = _ck("m", [("a@%", "y")])
    assert lmc.chunk_field(k3) != lmc.chunk_field(k4)


def test_lmcache_chunk_field_injective_exhaustive() -> None:
    """Every one-tag key over tag names and values of up to 3 of ``a @ % 2 5`` (and
    models of up to 2), and every two-tag key over pieces of up to 1: distinct keys give
    distinct chunk fields; a key of no separator gives LMCache's own string."""
    alpha = ["a", "@", "%", "2", "5"]
    seen: dict[str, tuple] = {}

    def check(model: str, tags: list[tuple[str, str]]) -> None:
        k = _ck(model, tags)
        f = lmc.chunk_field(k)
        ident = (model, tuple(tags))
        assert seen.setdefault(f, ident) == ident, (f, ident, seen[f])
        if "@" not in model and not model.startswith(ESCAPED) and all(
                "@" not in a + b and "%" not in a and not a.startswith(ESCAPED)
                and not b.startswith(ESCAPED) for a, b in tags):
            assert f == k.to_string()

    short = _strings(alpha, 3)
    for model in ("m", "m@"):
        for t, v in itertools.product(short, short):
            check(model, [(t, v)])
    one = _strings(alpha, 1)
    for model in _strings(["m", "@", "%"], 2):
        if not model:
            continue
        check(model, [])
        for a, b, c, d in itertools.product(one, repeat=4):
            if a != c:                  # (a dict: tag names differ)
                check(model, [(a, b), (c, d)])
