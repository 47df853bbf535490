"""Comma-separated list flags (``--mode plain,paged``, ``--num-resident 8,32``, ``--check-resident 4,32``,
``--sizes-mb 1,4``): one parse for every command, so that each refuses the same things the same way.

Owns ``comma_items``, ``comma_ints`` and ``comma_numbers``. An empty list, an empty item ("8," or "8,,32") and an
item given twice are refused, each error naming the flag: an empty item is a typo that once ran the
default or crashed later, and a repeated one ran (and timed) the same row twice.
"""

from __future__ import annotations

import math


def comma_items(text: str, flag: str, *, example: str, choices: tuple[str, ...] | None = None,
                repeat_hint: str = "") -> tuple[str, ...]:
    """The items of ``text`` split at commas, stripped, in order.

    Raises:
        ValueError: an empty list or item, an item given twice, or one not in ``choices`` (names the
            flag, the value and what it takes, e.g. ``example``; ``repeat_hint`` ends the repeat error).
    """
    items = _items(text, flag, f"{'values from ' + str(list(choices)) if choices else 'values'}, e.g. {example}")
    bad = [x for x in items if choices is not None and x not in choices]
    if bad:
        raise ValueError(f"unknown {flag} {bad}; choose from {list(choices)}")
    return _once(items, flag, repeat_hint)


def comma_ints(text: str, flag: str, *, example: str = "8,32") -> tuple[int, ...]:
    """The integers of ``text`` (comma-separated), in order; ``comma_items``' refusals, and
    ValueError for an item that is not an integer (names the flag)."""
    items = _items(text, flag, f"integers, e.g. {example}")
    try:
        values = tuple(int(x) for x in items)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: want comma-separated integers, e.g. {example}") from None
    return _once(values, flag, "")


def comma_numbers(text: str, flag: str, *, example: str) -> tuple[float, ...]:
    """The finite numbers > 0 of ``text`` (comma-separated), in order; ``comma_items``' refusals, and
    ValueError for an item that is not such a number (names the flag and the item)."""
    items = _items(text, flag, f"numbers > 0, e.g. {example}")
    try:
        values = tuple(float(x) for x in items)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: want comma-separated numbers > 0, e.g. {example}") from None
    bad = [x for x, v in zip(items, values) if not 0 < v < math.inf]
    if bad:
        raise ValueError(f"{flag} {text!r}: {bad} not a finite number > 0; want comma-separated numbers > 0, "
                         f"e.g. {example}")
    return _once(values, flag, "")


def _items(text: str, flag: str, want: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(","))
    if not text.strip():
        raise ValueError(f"{flag} {text!r} is empty: want comma-separated {want}")
    if not all(items):
        raise ValueError(f"{flag} {text!r} has an empty item: want comma-separated {want}")
    return items


def _once(values: tuple, flag: str, hint: str) -> tuple:
    repeated = sorted({v for v in values if values.count(v) > 1})  # "8,08": one K twice
    if repeated:
        raise ValueError(f"{flag} names {repeated} more than once; give each once{hint}")
    return values
