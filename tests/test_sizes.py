"""Tests of byte-size parsing and formatting (`jax_residency._src.policy.sizes`)."""

from __future__ import annotations

import reprlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_residency._src.errors import InvalidBudgetError, WeightResidencyPolicyError
from jax_residency._src.policy.sizes import (
  MAX_BYTES,
  GiB,
  KiB,
  MiB,
  TiB,
  format_bytes,
  parse_bytes,
)

_settings = settings(database=None, max_examples=300, deadline=None)

_UNIT_BYTES = {
  "B": 1,
  "kB": 1000,
  "KiB": 1024,
  "MB": 1000**2,
  "MiB": 1024**2,
  "GB": 1000**3,
  "GiB": 1024**3,
  "TB": 1000**4,
  "TiB": 1024**4,
}


def test_unit_constants():
  assert (KiB, MiB, GiB, TiB) == (1024, 1024**2, 1024**3, 1024**4)


@pytest.mark.parametrize(
  ("text", "expected"),
  [
    ("512MiB", 512 * 1024**2),
    ("4 GiB", 4 * 1024**3),
    ("1.5GB", 1_500_000_000),
    ("100kB", 100_000),
    ("100KB", 100_000),
    ("100kb", 100_000),
    ("1KiB", 1024),
    ("1 kib", 1024),
    ("2TB", 2 * 1000**4),
    ("2 TiB", 2 * 1024**4),
    ("3MB", 3_000_000),
    ("0", 0),
    ("0 GiB", 0),
    ("123", 123),
    ("123B", 123),
    ("123 b", 123),
    ("  7 MiB  ", 7 * 1024**2),
    ("1.0", 1),
    (".5KiB", 512),
    ("0.5 KiB", 512),
    ("1.25 KiB", 1280),
  ],
)
def test_parse_bytes_strings(text, expected):
  result = parse_bytes(text)
  assert result == expected
  assert type(result) is int


@pytest.mark.parametrize("value", [0, 1, 17, 4 * 1024**3, 10**18])
def test_parse_bytes_ints_pass_through(value):
  assert parse_bytes(value) == value


def test_parse_bytes_numpy_int_becomes_int():
  result = parse_bytes(np.int64(4096))  # type: ignore[arg-type]
  assert result == 4096
  assert type(result) is int


@pytest.mark.parametrize("value", [None, "none", "None", "NONE", "unbounded", " Unbounded "])
def test_parse_bytes_unbounded(value):
  assert parse_bytes(value) is None


@pytest.mark.parametrize(
  ("value", "reason"),
  [
    (-1, "negative"),
    (True, "bool"),
    (False, "bool"),
    (1.0, "float"),
    (1.5, "float"),
    ("", "not a byte size"),
    ("-1", "not a byte size"),
    ("-1GiB", "not a byte size"),
    ("GiB", "not a byte size"),
    ("4 XB", "unknown unit"),
    ("4 K", "unknown unit"),
    ("4 gibibytes", "unknown unit"),
    ("1.5", "whole number"),
    ("1.5B", "whole number"),
    ("0.1KiB", "whole number"),
    ("1e9", "not a byte size"),
    ("1,000", "not a byte size"),
    ("4 GiB 2", "not a byte size"),
    ([1], "list"),
    (b"1", "bytes"),
  ],
)
def test_parse_bytes_rejects(value, reason):
  with pytest.raises(InvalidBudgetError) as excinfo:
    parse_bytes(value)
  message = str(excinfo.value)
  assert repr(value) in message
  assert reason in message
  # The accepted forms are listed so the user can fix the value.
  for form in ("'512MiB'", "'4 GiB'", "'unbounded'", "KiB = 1024 B", "kB = 1000 B"):
    assert form in message


def test_parse_bytes_error_is_a_policy_value_error():
  with pytest.raises(ValueError):
    parse_bytes("lots")
  with pytest.raises(WeightResidencyPolicyError):
    parse_bytes(-5)


@pytest.mark.parametrize(
  ("value", "shown", "reason"),
  [
    ("1" * 5000, "'111111111111...1111111111111'", "has too many digits (5000)"),
    ("0." + "0" * 5000 + "1", "'0.0000000000...0000000000001'", "has too many digits (5003)"),
    ("1" * 4000 + " GiB", "'111111111111...111111111 GiB'", "is larger than MAX_BYTES"),
    (str(MAX_BYTES + 1), "'9223372036854775808'", "is larger than MAX_BYTES"),
    ("8193 PiB", "'8193 PiB'", "has unknown unit 'pib'"),
    (MAX_BYTES + 1, "9223372036854775808", "is larger than MAX_BYTES"),
    (10**5000, "<an int of about 5001 digits>", "is larger than MAX_BYTES"),
    (-(10**5000), "<an int of about 5001 digits>", "is negative"),
    ("1e400", "'1e400'", "is not a byte size"),
    ("nan", "'nan'", "is not a byte size"),
    ("inf", "'inf'", "is not a byte size"),
    ("-inf", "'-inf'", "is not a byte size"),
    ("Infinity", "'Infinity'", "is not a byte size"),
    (float("inf"), "inf", "has type float"),
    (float("nan"), "nan", "has type float"),
    ([1] * 1000, "[1, 1, 1, 1, 1, 1, ...]", "has type list"),
  ],
  ids=lambda v: f"{v.bit_length()}-bit-int" if isinstance(v, int) else reprlib.repr(v),
)
def test_parse_bytes_rejects_huge_and_non_finite_values_naming_them_briefly(value, shown, reason):
  with pytest.raises(InvalidBudgetError) as excinfo:
    parse_bytes(value, name="host_budget_bytes")
  message = str(excinfo.value)
  assert message.startswith(f"host_budget_bytes={shown} {reason}"), message
  assert len(message) < 600


def test_parse_bytes_accepts_up_to_max_bytes():
  assert MAX_BYTES == 2**63 - 1
  assert parse_bytes(MAX_BYTES) == parse_bytes(str(MAX_BYTES)) == MAX_BYTES
  assert format_bytes(MAX_BYTES) == "8388608.0 TiB"


def test_a_policy_budget_past_max_bytes_is_an_invalid_budget():
  import jax_residency as jr

  with pytest.raises(InvalidBudgetError, match="device_budget_bytes=<an int of about 401 digits>"):
    jr.FullyResident(device_budget_bytes=10**400)
  with pytest.raises(InvalidBudgetError, match=r"host_budget_bytes='1111.*too many digits"):
    jr.DenseDiskStream(host_budget_bytes="1" * 5000)


def test_parse_bytes_names_the_field():
  with pytest.raises(InvalidBudgetError, match=r"host_budget_bytes='3 parsecs'"):
    parse_bytes("3 parsecs", name="host_budget_bytes")


@pytest.mark.parametrize(
  ("n", "expected"),
  [
    (None, "unbounded"),
    (0, "0 B"),
    (17, "17 B"),
    (1023, "1023 B"),
    (1024, "1.0 KiB"),
    (1536, "1.5 KiB"),
    (1500, "1.5 KiB"),
    (100_000, "97.7 KiB"),
    (512 * 1024**2, "512.0 MiB"),
    (1024**2 - 1, "1.0 MiB"),  # 1023.999 KiB rounds up a unit, not to "1024.0 KiB".
    (4 * 1024**3, "4.0 GiB"),
    (16 * 1024**3, "16.0 GiB"),
    (5 * 1024**4, "5.0 TiB"),
    (2048 * 1024**4, "2048.0 TiB"),
    (-1536, "-1.5 KiB"),
    (-17, "-17 B"),
  ],
)
def test_format_bytes(n, expected):
  assert format_bytes(n) == expected


@pytest.mark.parametrize("n", [True, 1.0, "1 GiB"])
def test_format_bytes_rejects_non_ints(n):
  with pytest.raises(InvalidBudgetError, match=repr(n).replace(".", r"\.")):
    format_bytes(n)


@_settings
@given(st.integers(min_value=0, max_value=2**62))
def test_ints_and_their_decimal_strings_parse_to_themselves(n):
  assert parse_bytes(n) == n
  assert parse_bytes(str(n)) == n


@_settings
@given(
  count=st.integers(min_value=0, max_value=10**6),
  unit=st.sampled_from(sorted(_UNIT_BYTES)),
  space=st.sampled_from(["", " ", "  "]),
  case=st.sampled_from([str.lower, str.upper, lambda s: s]),
)
def test_whole_unit_counts_parse_exactly(count, unit, space, case):
  assert parse_bytes(f"{count}{space}{case(unit)}") == count * _UNIT_BYTES[unit]


@_settings
@given(st.integers(min_value=0, max_value=2**60))
def test_format_bytes_parses_back_within_rounding(n):
  text = format_bytes(n)
  number, unit = text.split(" ")
  approx = float(number) * _UNIT_BYTES[unit]
  # One decimal in a unit of at most 1024x the value: error <= 0.05 / 1 of the unit.
  assert abs(approx - n) <= 0.05 * _UNIT_BYTES[unit] + 1e-9 * n
  assert float(number) < 1024 or unit == "TiB"
  assert float(number) >= 1 or n == 0


@_settings
@given(st.integers(min_value=1, max_value=1023), st.sampled_from(["KiB", "MiB", "GiB", "TiB"]))
def test_format_bytes_whole_units(k, unit):
  assert format_bytes(k * _UNIT_BYTES[unit]) == f"{k}.0 {unit}"
