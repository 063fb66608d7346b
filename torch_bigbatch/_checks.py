"""Argument checks shared by the package's Python parts."""

import operator


def is_int(value):
    """An int and not a bool (bool is an int subclass: True would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_index(value):
    """`value` as an int where operator.index takes it (ints, numpy's integers), not a bool;
    else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
