"""Byte quantities: parse a user's memory budget, print byte counts for humans, and count a tensor's
storage bytes (without importing torch: the CLI's --help must stay fast)."""

from __future__ import annotations

import math
import numbers
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Decimal units follow the SI (what disk and cloud vendors print); the "i" units are
# binary (what nvidia-smi and torch.cuda.memory_allocated report). Both are common
# when people state a GPU budget, so both are accepted and never guessed at.
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

# A number (digits with an optional fraction) directly followed by an optional unit.
# No inner whitespace: "20 gb" is rejected so that a typo is never half-understood.
_BUDGET_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([a-z]*)")

_ACCEPTED = (
    'a positive number of bytes or a string like "20GB" (10^9), "20GiB" (2^30), '
    '"512MB", "512MiB", "64KB", "64KiB"'
)


def _bad_budget(value: object) -> ValueError:
    return ValueError(f"budget must be {_ACCEPTED}; got {value!r}")


def parse_budget(value: float | str) -> int:
    """Return a memory budget in bytes from an int, a float or a string such as "20GB"."""
    # bool is an int subclass; True meaning "1 byte" would be a silent bug.
    if isinstance(value, bool):
        raise _bad_budget(value)
    if isinstance(value, numbers.Integral):
        if value <= 0:
            raise _bad_budget(value)
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(value) or round(value) <= 0:
            raise _bad_budget(value)
        return round(value)
    if not isinstance(value, str):
        raise _bad_budget(value)
    match = _BUDGET_RE.fullmatch(value.strip().lower())
    if match is None or match.group(2) not in ("", *_UNITS):
        raise _bad_budget(value)
    number, unit = match.groups()
    scale = _UNITS[unit or "b"]
    # Integer arithmetic where possible so that "20GiB" is exactly 20 * 2**30.
    if "." in number:
        nbytes = round(float(number) * scale)
    else:
        nbytes = int(number) * scale
    if nbytes <= 0:
        raise _bad_budget(value)
    return nbytes


def format_bytes(n: float, si: bool = False) -> str:
    """Human-readable size: binary units by default ("1.50 GiB"), decimal ones with si=True."""
    base = 1000 if si else 1024
    names = ("KB", "MB", "GB", "TB", "PB") if si else ("KiB", "MiB", "GiB", "TiB", "PiB")
    if abs(n) < base:
        return f"{round(n)} B"
    value, unit = float(n), "B"
    for unit in names:
        value /= base
        if abs(value) < base or unit == names[-1]:
            break
    # Two decimals for small mantissas, one above 100: about four significant digits.
    return f"{value:.2f} {unit}" if abs(value) < 100 else f"{value:.1f} {unit}"


def round_up(n: int, granularity: int) -> int:
    """`n` bytes as the allocator hands them out: in whole blocks of `granularity` (512 on CUDA)."""
    return -(-n // granularity) * granularity


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the storage behind `t`.

    The StorageImpl address identifies a storage even on the meta device, where every
    data_ptr() is 0; views and tied weights share it. Tensor subclasses without a
    plain storage count as their own allocation.
    """
    try:
        storage = t.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t), t.numel() * t.element_size()
