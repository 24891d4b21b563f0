"""The checks and the dict codec the policies' option dataclasses share (`options`,
`experts`): field validators that name the owner, the field and a fix, and `Options`,
the base of every options class. Pure Python, no JAX."""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Self, TypeVar, cast

from jax_residency._src.errors import (
  InvalidBudgetError,
  InvalidPolicyValueError,
  UnknownPolicyFieldError,
)
from jax_residency._src.policy.sizes import format_bytes, parse_bytes

_E = TypeVar("_E", bound=enum.Enum)


class CacheEvictionPolicy(enum.Enum):
  """Which cached unit a full cache evicts first.

  `LEAST_FREQUENTLY_USED` breaks ties by older last use first, then unit id.

  Example:
    >>> CacheEvictionPolicy.LEAST_RECENTLY_USED.value
    'least_recently_used'
  """

  LEAST_RECENTLY_USED = "least_recently_used"
  LEAST_FREQUENTLY_USED = "least_frequently_used"

  def __repr__(self) -> str:
    return f"{type(self).__name__}.{self.name}"


# --- field checks ----------------------------------------------------------


def check_budget(owner: str, field: str, value: object) -> int | None:
  """Returns a byte budget (an int, a size string or `None`) as an int or `None`."""
  try:
    return parse_bytes(cast(Any, value), name=field)
  except InvalidBudgetError as e:
    raise InvalidBudgetError(f"{owner}: {e}") from None


def check_int(owner: str, field: str, value: object, example: int) -> int:
  """Returns `value` as an int; a bool or non-integer raises, suggesting `field=example`."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise InvalidPolicyValueError(
      f"{owner}: {field}={value!r} has type {type(value).__name__}; "
      f"pass an int, e.g. {field}={example}."
    )
  return int(value)


def check_units(owner: str, field: str, value: object) -> int:
  """A count of units (an int >= 0), or `InvalidPolicyValueError` naming the field."""
  count = check_int(owner, field, value, 2)
  if count < 0:
    raise InvalidPolicyValueError(
      f"{owner}: {field}={count!r} is negative; pass a number of units of each stack "
      "(>= 0; 0, the default, keeps none)."
    )
  return count


def check_bool(owner: str, field: str, value: object) -> bool:
  if not isinstance(value, bool):
    raise InvalidPolicyValueError(
      f"{owner}: {field}={value!r} has type {type(value).__name__}; pass True or False."
    )
  return value


def check_member(owner: str, field: str, value: object, kind: type[_E]) -> _E:
  if not isinstance(value, kind):
    members = ", ".join(repr(m) for m in kind)
    raise InvalidPolicyValueError(
      f"{owner}: {field}={value!r} has type {type(value).__name__}; pass one of {members}."
    )
  return value


def decode_member(owner: str, field: str, value: object, kind: type[_E]) -> object:
  """Maps an enum's serialized name (any case) to the member; leaves non-strings alone."""
  if not isinstance(value, str):
    return value
  for member in kind:
    if value.lower() == member.value:
      return member
  valid = ", ".join(repr(m.value) for m in kind)
  raise UnknownPolicyFieldError(f"{owner}: {field}={value!r} is not one of {valid}.")


def check_keys(owner: str, data: object, valid: Iterable[str]) -> Mapping[str, Any]:
  """Returns `data` if it is a mapping whose keys are all in `valid` (a `from_dict` input)."""
  if not isinstance(data, Mapping):
    raise InvalidPolicyValueError(
      f"{owner}.from_dict got {type(data).__name__} {data!r}; pass a dict such as "
      f"the one {owner}.to_dict() returns."
    )
  valid = list(valid)
  for key in data:
    if key not in valid:
      raise UnknownPolicyFieldError(
        f"{owner}: unknown key {key!r}; valid keys are {', '.join(map(repr, valid))}."
      )
  return data


def format_budget(n: int | None) -> str:
  """Formats a budget in human units, adding the exact bytes where those do not round-trip."""
  text = format_bytes(n)
  try:
    exact = parse_bytes(text) == n
  except InvalidBudgetError:
    exact = False
  return text if exact else f"{text} ({n} B)"


class Options:
  """Dict codec and human-unit repr shared by the option dataclasses."""

  __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
  #: Fields that hold options of their own: ``from_dict`` builds them from their dicts.
  _nested: ClassVar[dict[str, type[Options]]] = {}

  @classmethod
  def default(cls) -> Self:
    """Returns the instance with every field at its default."""
    return cast(Any, cls)()

  def to_dict(self) -> dict[str, Any]:
    """Returns a JSON-compatible dict: budgets as ints, enums by lower-case name."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, enum.Enum):
        value = value.value
      elif isinstance(value, Options):
        value = value.to_dict()
      out[f.name] = value
    return out

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> Self:
    """Builds and validates an instance from `to_dict()` output; missing keys take defaults.

    Budgets may also be size strings (`"512MiB"`). An unknown key, or an unknown
    enum name, raises `UnknownPolicyFieldError`.
    """
    owner = cls.__name__
    data = check_keys(owner, data, (f.name for f in dataclasses.fields(cls)))
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
      if key == "eviction_policy":
        value = decode_member(owner, key, value, CacheEvictionPolicy)
      elif key in cls._nested and isinstance(value, Mapping):
        value = cls._nested[key].from_dict(value)
      kwargs[key] = value
    return cast(Any, cls)(**kwargs)

  def _check_budgets(self) -> str:
    """Validates ``device_budget_bytes`` / ``host_budget_bytes`` (parsing size strings); returns
    the class name errors are reported under."""
    owner = type(self).__name__
    for name in ("device_budget_bytes", "host_budget_bytes"):
      object.__setattr__(self, name, check_budget(owner, name, getattr(self, name)))
    return owner

  def __repr__(self) -> str:
    parts = []
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      text = format_budget(value) if f.name.endswith("_budget_bytes") else repr(value)
      parts.append(f"{f.name}={text}")
    return f"{type(self).__name__}({', '.join(parts)})"
