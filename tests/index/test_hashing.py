"""Block hashing: Dynamo's published vectors, input forms, and clear errors on bad input."""

from __future__ import annotations

import kvroute
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# Dynamo 1.6.1 `compute_block_hash_for_seq` (local) and its chained sequence hashes.
LOCAL_0_16 = [15310707395893867146]
LOCAL_0_64_B16 = [15310707395893867146, 15292316782987903195, 5532946206955930018, 14928757266181269122]
SEQ_0_64_B16 = [15310707395893867146, 13769157705258532664, 11879827756109914528, 3888788807566526800]
LOCAL_0_128_B64 = [3480597578098033343, 3318286205056455972]


def test_known_vectors() -> None:
    assert kvroute.local_block_hashes(list(range(16)), 16).tolist() == LOCAL_0_16
    assert kvroute.local_block_hashes(list(range(64)), 16).tolist() == LOCAL_0_64_B16
    assert kvroute.block_hashes(list(range(64)), 16).tolist() == SEQ_0_64_B16
    assert kvroute.local_block_hashes(list(range(128)), 64).tolist() == LOCAL_0_128_B64
    assert kvroute.block_hashes(list(range(128)), 64)[0] == LOCAL_0_128_B64[0]


def test_output_is_uint64_and_only_full_blocks() -> None:
    out = kvroute.block_hashes(list(range(64 * 3 + 63)), 64)
    assert out.dtype == np.uint64 and out.shape == (3,)
    assert kvroute.block_hashes([], 64).shape == (0,)
    assert kvroute.block_hashes(list(range(63)), 64).shape == (0,)


@pytest.mark.parametrize("dtype", [np.uint32, np.int64, np.int32, np.uint16, np.uint64, np.int8])
def test_numpy_dtypes_agree_with_lists(dtype: type) -> None:
    toks = [i % 100 for i in range(300)]
    arr = np.asarray(toks, dtype=dtype)
    assert kvroute.block_hashes(arr, 16).tolist() == kvroute.block_hashes(toks, 16).tolist()


def test_non_contiguous_uint32() -> None:
    base = np.arange(512, dtype=np.uint32)
    view = base[::2]
    assert not view.flags["C_CONTIGUOUS"]
    assert kvroute.block_hashes(view, 16).tolist() == kvroute.block_hashes(view.tolist(), 16).tolist()


def test_seed_changes_hashes() -> None:
    a = kvroute.block_hashes(list(range(64)), 16, seed=1337)
    b = kvroute.block_hashes(list(range(64)), 16, seed=0)
    assert a.tolist() != b.tolist()


@pytest.mark.parametrize(
    ("tokens", "exc", "msg"),
    [
        ([1, -1], ValueError, "negative|out of range"),
        ([1, 2**32], ValueError, "out of range"),
        (np.array([1, -5], dtype=np.int64), ValueError, "negative"),
        (np.array([2**32], dtype=np.uint64), ValueError, "out of range"),
        (np.zeros((2, 4), dtype=np.uint32), ValueError, "1-D"),
        (np.zeros(4, dtype=np.float32), TypeError, "integers"),
        ([1.5, 2], TypeError, "must be an int"),
        ("abc", TypeError, "str"),
        (5, TypeError, "sequence"),
        ([True, 1], TypeError, "bool"),
    ],
)
def test_bad_tokens_raise_clear_errors(tokens: object, exc: type, msg: str) -> None:
    with pytest.raises(exc, match=msg):
        kvroute.block_hashes(tokens, 16)


@pytest.mark.parametrize("bs", [0, -3])
def test_bad_block_size(bs: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        kvroute.block_hashes([1, 2, 3], bs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 40))
def test_chain_property(tokens: list[int], bs: int) -> None:
    """Hashing a prefix gives a prefix of the hashes (the chain depends only on what came before)."""
    full = kvroute.block_hashes(tokens, bs).tolist()
    cut = len(tokens) // 2
    assert kvroute.block_hashes(tokens[:cut], bs).tolist() == full[: cut // bs]
    assert len(kvroute.local_block_hashes(tokens, bs)) == len(full)


def test_matches_dynamo_byte_for_byte() -> None:
    dyn = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is not installed")
    rng = np.random.default_rng(7)
    for n, bs in [(64, 16), (8192, 64), (1000, 32)]:
        toks = rng.integers(0, 2**31, size=n, dtype=np.uint32).tolist()
        assert kvroute.local_block_hashes(toks, bs).tolist() == list(dyn.compute_block_hash_for_seq(toks, bs))


def test_chain_hashes_matches_block_hashes() -> None:
    toks = list(range(64 * 5))
    local = kvroute.local_block_hashes(toks, 64)
    full = kvroute.block_hashes(toks, 64)
    assert kvroute.chain_hashes(local).tolist() == full.tolist()
    assert kvroute.chain_hashes(local[2:], parent=int(full[1])).tolist() == full[2:].tolist()
    with pytest.raises(ValueError):
        kvroute.chain_hashes([-1])
