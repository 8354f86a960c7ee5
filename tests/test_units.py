import math

import pytest
import torch

from autoremat.units import format_bytes, parse_budget

torch.set_num_threads(1)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("20GB", 20 * 10**9),
        ("20GiB", 20 * 2**30),
        ("20gib", 20 * 2**30),
        ("  20GB\n", 20 * 10**9),
        ("1.5GB", 1_500_000_000),
        ("1.5MiB", 1_572_864),
        ("512MB", 512 * 10**6),
        ("64KiB", 65_536),
        ("64kb", 64_000),
        ("2TB", 2 * 10**12),
        ("1TiB", 2**40),
        ("100B", 100),
        ("1000000", 1_000_000),
        (".5KiB", 512),
        (4096, 4096),
        (4096.0, 4096),
        (1e9, 10**9),
    ],
)
def test_parse_budget_good(value, expected):
    got = parse_budget(value)
    assert got == expected
    assert type(got) is int


@pytest.mark.parametrize(
    "value",
    [-1, 0, 0.0, -2.5, float("nan"), float("inf"), "20 gb", "twenty", "", "   ", "20XB", "GB",
     "-1GB", "0GB", "1e9", "20GB!", True, False, None, [20]],
)
def test_parse_budget_bad(value):
    with pytest.raises(ValueError) as err:
        parse_budget(value)
    message = str(err.value)
    # The message must say what was given and which forms are accepted.
    assert repr(value) in message
    assert '"20GB"' in message and '"20GiB"' in message


def test_parse_budget_is_exact_for_large_integers():
    # Integer arithmetic: no float rounding even far beyond 2**53.
    assert parse_budget("123456789123456789TiB") == 123456789123456789 * 2**40


def test_format_bytes():
    assert format_bytes(12) == "12 B"
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.00 KiB"
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"
    assert format_bytes(512 * 2**20) == "512.0 MiB"
    assert format_bytes(14 * 10**9) == "13.04 GiB"
    assert format_bytes(-3 * 2**30) == "-3.00 GiB"
    assert format_bytes(-12) == "-12 B"
    assert format_bytes(2**60) == "1024.0 PiB"  # the largest unit keeps growing


def test_format_bytes_si():
    assert format_bytes(14 * 10**9, si=True) == "14.00 GB"
    assert format_bytes(999, si=True) == "999 B"
    assert format_bytes(1500, si=True) == "1.50 KB"
    assert format_bytes(250 * 10**6, si=True) == "250.0 MB"


def test_format_parse_round_trip():
    for n in (1, 1000, 3 * 2**20, 7 * 2**30):
        text = format_bytes(n).replace(" ", "")
        assert math.isclose(parse_budget(text), n, rel_tol=5e-3)
