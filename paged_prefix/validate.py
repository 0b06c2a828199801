"""Integer checks at the boundary: a ValueError naming the field, never a silent truncation.

numpy would turn 11.7 into 11, True into 1 and a 2**70 into an object array; a block id or
token id that is not exactly an in-range integer is a caller's bug and is refused here.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

MAX_INT32, MAX_INT64, MIN_INT64 = 2**31 - 1, 2**63 - 1, -2**63
_BOOLS = {bool, np.bool_}


def index_dtype(count: int) -> type[np.integer]:
    """The integer type for indices into `count` rows: int32 while every index fits it."""
    return np.int32 if count <= MAX_INT32 + 1 else np.int64


def _bounds(field: str, low: int | None, high: int | None) -> str:
    return f"{field}: expected integers in [{'-inf' if low is None else low}, " \
           f"{'inf' if high is None else high}]"


def as_int(value, field: str, low: int | None = None, high: int | None = None) -> int:
    if type(value) is not int:  # a plain int (never a bool) skips the slower checks
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{field}: expected an int, got {value!r} ({type(value).__name__})")
        value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{_bounds(field, low, high)}, got {value}")
    return value


def as_ints(values: Sequence[int] | np.ndarray, field: str, low: int | None = None,
            high: int | None = None) -> np.ndarray:
    """values as int64, each an exact integer within [low, high]."""
    if not isinstance(values, (np.ndarray, Sequence)) or isinstance(values, (str, bytes)):
        raise ValueError(f"{field}: expected a flat list of integers, got "
                         f"{type(values).__name__}")
    if not isinstance(values, np.ndarray) and _BOOLS & set(map(type, values)):
        # numpy reads [3, True] as int64 [3, 1]: a bool among ints is found only here
        raise ValueError(f"{field}: expected integers, got a bool among them")
    try:
        arr = np.asarray(values)
    except (OverflowError, ValueError) as e:
        raise ValueError(f"{field}: expected a flat list of integers ({e})") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{field}: expected a flat list of integers, got shape {arr.shape}")
    if arr.dtype.kind == "O":  # Python ints past int64, or mixed objects
        bad = next(v for v in arr.tolist()
                   if isinstance(v, bool) or not isinstance(v, numbers.Integral)
                   or not MIN_INT64 <= v <= MAX_INT64)
        raise ValueError(f"{_bounds(field, low, high)}, got {bad!r}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{field}: expected integers, got {arr.dtype} values such as "
                         f"{arr.ravel()[0]!r}")
    if arr.dtype == np.uint64 and arr.max() > MAX_INT64:
        raise ValueError(f"{_bounds(field, low, high)}, got {arr.max()}")
    arr = arr.astype(np.int64, copy=arr is values)  # the caller's array is never handed back
    # two reductions: every step checks its ids here, most of them a handful
    if (low is not None and arr.min() < low) or (high is not None and arr.max() > high):
        out_of_range = (arr < (MIN_INT64 if low is None else low)) | \
            (arr > (MAX_INT64 if high is None else high))
        raise ValueError(f"{_bounds(field, low, high)}, got {arr[out_of_range][:5].tolist()}")
    return arr


def frozen(arr: np.ndarray) -> np.ndarray:
    """A read-only host array (the per-forward metadata is built once, then only read)."""
    arr = np.array(arr)
    arr.flags.writeable = False
    return arr
