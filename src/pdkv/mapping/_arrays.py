"""Index-array intake and compact summaries shared by the mapping modules.

Owns: turning caller input (numpy arrays, integer sequences, CPU torch tensors) into 1-D int64
arrays, refusing anything that lives on an accelerator, and the short summaries that every
``MappingError`` carries. Must not import torch (a torch tensor is recognised by duck typing) and
must never move data off a device: a device-to-host copy here would be a hidden synchronisation on
the scheduler's control path, so a CUDA tensor is an error, not a conversion.

Intake may return a view of the caller's memory (a CPU tensor's storage, say); the public mapping
functions therefore never put an intake array itself into a result: their outputs are fresh arrays
that stay valid when the caller reuses its index buffers.
"""

from __future__ import annotations

from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from pdkv.errors import MappingError

IntArray: TypeAlias = npt.NDArray[np.int64]

SUMMARY_EDGE: Final = 3  # ids shown at each end of an array in an error message

SMALL_ARRAY: Final = 32
"""Up to this many items the reductions below go through a Python list: a numpy reduction costs about
1 µs whatever the size (and a 1-page room makes a few dozen of them on its way), a list's 0.1-0.6 µs."""


def int_min(arr: npt.NDArray[Any]) -> int:
    """The smallest item of a non-empty 1-D integer array, as an int (ValueError when empty)."""
    return int(min(arr.tolist())) if arr.size <= SMALL_ARRAY else int(arr.min())


def int_max(arr: npt.NDArray[Any]) -> int:
    """The largest item of a non-empty 1-D integer array, as an int (ValueError when empty)."""
    return int(max(arr.tolist())) if arr.size <= SMALL_ARRAY else int(arr.max())


def int_bounds(arr: npt.NDArray[Any]) -> tuple[int, int]:
    """(smallest, largest) item of a non-empty 1-D integer array, as ints (ValueError when empty)."""
    if arr.size <= SMALL_ARRAY:
        items = arr.tolist()
        return int(min(items)), int(max(items))
    return int(arr.min()), int(arr.max())


def int_sum(arr: npt.NDArray[Any]) -> int:
    """The sum of a 1-D integer array, as an int (0 when empty)."""
    return int(sum(arr.tolist())) if arr.size <= SMALL_ARRAY else int(arr.sum())


def any_true(arr: npt.NDArray[Any]) -> bool:
    """Whether any item of a 1-D array is non-zero (False when empty)."""
    return any(arr.tolist()) if arr.size <= SMALL_ARRAY else bool(arr.any())


def all_true(arr: npt.NDArray[Any]) -> bool:
    """Whether every item of a 1-D array is non-zero (True when empty)."""
    return all(arr.tolist()) if arr.size <= SMALL_ARRAY else bool(arr.all())


def device_of(value: object) -> str:
    """The device a tensor-like lives on (``"cpu"`` for numpy arrays, lists and CPU tensors).

    torch exposes ``.device.type`` and ``.is_cuda``; numpy 2 exposes ``.device == "cpu"``.
    """
    if getattr(value, "is_cuda", False) is True:
        return "cuda"
    device = getattr(value, "device", None)
    if device is None:
        return "cpu"
    kind = getattr(device, "type", device)
    return kind if isinstance(kind, str) else str(kind)


def as_index_array(value: object, name: str) -> IntArray:
    """``value`` as a 1-D contiguous int64 array (a view when it already is one).

    Raises ``MappingError`` for accelerator tensors, non-integer dtypes and other shapes.
    """
    if (
        type(value) is np.ndarray
        and value.dtype == np.int64
        and value.ndim == 1
        and value.size
        and value.flags.c_contiguous
    ):
        # Already what the checks below would return (the mapping functions hand their own arrays to
        # each other): skipping them saves several times the arithmetic of a 1-page chunk.
        return value
    device = device_of(value)
    if device != "cpu":
        raise MappingError(
            f"{name}: index arrays must live on the CPU, got a tensor on {device!r}; "
            "copy it to the host where the caller can account for the synchronisation"
        )
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise MappingError(f"{name}: index arrays are 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise MappingError(f"{name}: index arrays hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise MappingError(f"{name}: index {int(arr.max())} does not fit in int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def as_non_negative_index_array(value: object, name: str) -> IntArray:
    """``as_index_array`` that also refuses negative ids (page ids, positions, slots)."""
    arr = as_index_array(value, name)
    if arr.size and int_min(arr) < 0:
        first_bad = int(np.flatnonzero(arr < 0)[0])
        raise MappingError(
            f"{name}: ids are non-negative, got {int(arr[first_bad])} at index {first_bad}; "
            f"{summarize(arr, name)}"
        )
    return arr


def count_runs(arr: IntArray) -> int:
    """Number of maximal runs of consecutive ids (each next id is the previous + 1)."""
    if arr.size == 0:
        return 0
    return 1 + int(np.count_nonzero(np.diff(arr) != 1))


def summarize(arr: IntArray, name: str) -> str:
    """``name: n=2048 runs=1 [0 1 2 ... 2045 2046 2047]``: enough to act on, never the whole list."""
    n = int(arr.size)
    if n <= 2 * SUMMARY_EDGE:
        body = " ".join(str(int(x)) for x in arr)
    else:
        head = " ".join(str(int(x)) for x in arr[:SUMMARY_EDGE])
        tail = " ".join(str(int(x)) for x in arr[-SUMMARY_EDGE:])
        body = f"{head} ... {tail}"
    return f"{name}: n={n} runs={count_runs(arr)} [{body}]"


def check_int(value: object, name: str, *, minimum: int) -> int:
    """A plain int (bool refused) of at least ``minimum``; numpy integers are accepted."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise MappingError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    out = int(value)
    if out < minimum:
        raise MappingError(f"{name} must be >= {minimum}, got {out}")
    return out
