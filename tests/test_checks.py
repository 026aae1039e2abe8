"""``check_int``: the one validator of integer settings, and its wording."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loader.checks import check_int
from loader.errors import ConfigError


@given(st.integers(), st.integers(-5, 5), st.integers(-5, 5))
def test_an_int_passes_exactly_when_within_its_bounds(value, low, span):
    high = low + abs(span)
    inside = low <= value <= high
    if inside:
        assert check_int("n", value, minimum=low, maximum=high) == value
    else:
        with pytest.raises(ConfigError, match=rf"^n={value} must be (>= {low}|<= {high})$"):
            check_int("n", value, minimum=low, maximum=high)


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, [1]])
def test_anything_but_an_int_is_refused_bools_included(value):
    with pytest.raises(ConfigError, match=rf"^x={value!r} is not an int$".replace("[", r"\[")):
        check_int("x", value)


def test_must_words_every_failure_and_optional_lets_none_pass():
    for bad in (0, True, "3"):
        with pytest.raises(ConfigError, match=rf"^size={bad!r} must be a positive integer$"):
            check_int("size", bad, minimum=1, must="a positive integer")
    assert check_int("size", None, minimum=1, optional=True) is None
    with pytest.raises(ConfigError, match=r"size=None is not an int"):
        check_int("size", None, minimum=1)


def test_settings_keep_their_messages():
    from loader.engine import EngineLimits
    from loader.listing.keylist import ListOptions

    with pytest.raises(ConfigError, match=r"^max_inflight=True must be a positive integer$"):
        EngineLimits(max_inflight=True)
    with pytest.raises(ConfigError, match=r"^inflight_bytes=0 must be a positive integer or None$"):
        EngineLimits(inflight_bytes=0)
    with pytest.raises(ConfigError, match=r"^ListOptions.concurrency=0 must be a positive integer$"):
        ListOptions(concurrency=0)
