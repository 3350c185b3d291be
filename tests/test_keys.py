"""kvshm.keys: the recipe as documented, and prefix properties (hypothesis)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm import keys as K

tokens_st = st.lists(st.integers(0, 2 ** 31 - 1), max_size=40)


def _reference(tokens: list[int], bs: int, algo: str, partial: bool) -> list[bytes]:
    """The recipe of the module docstring, written out independently."""
    H = (lambda b: hashlib.sha256(b).digest()) if algo == "sha256" else \
        (lambda b: xxhash.xxh3_128(b).digest())
    prev = H(b"kvshm.keys/v1")
    out = []
    n = len(tokens) if partial else len(tokens) - len(tokens) % bs
    for i in range(0, n, bs):
        block = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[i:i + bs])
        prev = H(prev + block)
        out.append(prev)
    return out


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
@pytest.mark.parametrize("partial", [False, True])
def test_recipe_matches_docstring(algo: str, partial: bool) -> None:
    toks = [0, 1, 2, 70000, 2 ** 31 - 1, 5, 6]
    assert K.block_hashes(toks, 3, algo=algo, partial=partial) == \
        _reference(toks, 3, algo, partial)
    ks = K.KeySpace("org/model|x", "bfloat16", tp_rank=1, tp_size=4, layer=7,
                    block_size=3, algo=algo)
    ns = b"kvshm1|org%2Fmodel%7Cx|bfloat16|tp1of4|L7|" + \
        (b"" if algo == "sha256" else b"algo=xxh3_128|")
    assert ks.prefix == ns
    assert ks.keys(toks, partial=partial) == \
        [ns + h.hex().encode() for h in _reference(toks, 3, algo, partial)]


def test_fixed_vector() -> None:
    # pins the recipe: a change here changes every key users have stored
    k = K.token_keys([1, 2, 3, 4], model="m", dtype="float16", block_size=2)
    assert k[0] == (b"kvshm1|m|float16|tp0of1|Lall|" + hashlib.sha256(
        hashlib.sha256(b"kvshm.keys/v1").digest() + bytes([1, 0, 0, 0, 2, 0, 0, 0])
    ).hexdigest().encode())
    assert len(k) == 2


def test_inputs_and_dtypes() -> None:
    toks = list(range(20))
    a = K.block_hashes(toks, 4)
    assert K.block_hashes(np.array(toks, np.int64), 4) == a
    assert K.block_hashes(np.array(toks, np.uint16), 4) == a
    assert K.block_hashes([], 4) == []
    assert K.block_hashes(toks[:3], 4) == []
    assert len(K.block_hashes(toks[:3], 4, partial=True)) == 1
    assert K.namespace("m", np.float16) == K.namespace("m", "float16")
    with pytest.raises(ValueError):
        K.block_hashes([-1], 1)
    with pytest.raises(ValueError):
        K.block_hashes([2 ** 31], 1)
    with pytest.raises(TypeError):
        K.block_hashes([1.5], 1)
    with pytest.raises(ValueError):
        K.block_hashes([1], 0)
    with pytest.raises(ValueError):
        K.block_hashes([1], 1, algo="md5")
    with pytest.raises(ValueError):
        K.namespace("m", "bf16", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError):
        K.namespace("", "bf16")


def test_torch_tensor_tokens() -> None:
    torch = pytest.importorskip("torch")
    toks = list(range(9))
    assert K.block_hashes(torch.tensor(toks), 3) == K.block_hashes(toks, 3)


def test_chain_continues_with_parent() -> None:
    toks = list(range(12))
    whole = K.block_hashes(toks, 4)
    head = K.block_hashes(toks[:4], 4)
    tail = K.block_hashes(toks[4:], 4, parent=head[-1])
    assert head + tail == whole


def test_namespaces_separate_keys() -> None:
    toks = list(range(8))
    base = K.KeySpace("m", "bfloat16", 0, 2, layer=0, block_size=4)
    variants = [base, base.with_rank(1), base.with_layer(1), base.with_layer(None),
                K.KeySpace("m2", "bfloat16", 0, 2, 0, 4), K.KeySpace("m", "float16", 0, 2, 0, 4),
                K.KeySpace("m", "bfloat16", 0, 4, 0, 4),
                K.KeySpace("m", "bfloat16", 0, 2, 0, 4, algo="xxh3_128")]
    all_keys = [k for v in variants for k in v.keys(toks)]
    assert len(set(all_keys)) == len(all_keys)
    # the chain does not depend on the namespace: hashes once, keys for every layer
    hs = base.hashes(toks)
    assert base.with_layer(5).keys_from_hashes(hs) == base.with_layer(5).keys(toks)


@settings(max_examples=200, deadline=None)
@given(common=tokens_st, a=tokens_st, b=tokens_st, bs=st.integers(1, 6),
       partial=st.booleans())
def test_prefix_equal_tokens_give_prefix_equal_keys(common: list[int], a: list[int],
                                                    b: list[int], bs: int,
                                                    partial: bool) -> None:
    ks = K.KeySpace("m", "bfloat16", block_size=bs, algo="xxh3_128")
    ka, kb = ks.keys(common + a, partial=partial), ks.keys(common + b, partial=partial)
    ta, tb = common + a, common + b
    for i in range(min(len(ka), len(kb))):
        hi = (i + 1) * bs
        if ta[:hi] == tb[:hi]:          # same tokens up to the end of block i
            assert ka[i] == kb[i]
        else:
            # once the tokens differ, every later key differs too (the chain diverges)
            assert all(x != y for x, y in zip(ka[i:], kb[i:]))
            break
    # the shared full blocks of ``common`` always give equal leading keys
    n_common = len(common) // bs
    assert ka[:n_common] == kb[:n_common]
    assert ks.keys(common)[:n_common] == ka[:n_common]


@settings(max_examples=200, deadline=None)
@given(toks=st.lists(st.integers(0, 2 ** 31 - 1), min_size=1, max_size=30),
       pos=st.integers(0, 29), new=st.integers(0, 2 ** 31 - 1), bs=st.integers(1, 5))
def test_one_changed_token_changes_its_block_and_all_after(toks: list[int], pos: int,
                                                           new: int, bs: int) -> None:
    pos %= len(toks)
    if toks[pos] == new:
        new = (new + 1) % 2 ** 31
    other = list(toks)
    other[pos] = new
    a = K.block_hashes(toks, bs, partial=True)
    b = K.block_hashes(other, bs, partial=True)
    changed = pos // bs
    assert a[:changed] == b[:changed]
    assert all(x != y for x, y in zip(a[changed:], b[changed:]))
