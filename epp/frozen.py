"""Frozen dataclass instances built fast, for the few hot paths that build many. Pure.

A frozen slots dataclass's `__init__` sets each field through `object.__setattr__`, about 0.1 us a
field. `twin(cls)` makes a mutable slots dataclass with the same fields, in the same order; building
one and assigning `__class__ = cls` gives an ordinary `cls` instance (equal, hashable, frozen from
then on) about 3x faster. Python refuses the assignment unless both slot layouts match: `twin`
checks it once, when it is called (at import). Fields with `init=False` are fields of the twin like
any other: the caller sets them before the swap.
"""

from __future__ import annotations

from dataclasses import fields, make_dataclass
from typing import Any


def twin(cls: type) -> Any:
    """The mutable twin of frozen slots dataclass `cls` (see the module docstring)."""
    names = [f.name for f in fields(cls)]
    made = make_dataclass(f"_{cls.__name__}Twin", names, slots=True)
    probe = made(*names)
    probe.__class__ = cls  # TypeError here, at import, if the layouts differ
    return made
