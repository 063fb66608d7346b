"""Argument checks shared by the package's Python parts."""


def is_int(value):
    """An int and not a bool (bool is an int subclass: True would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)
