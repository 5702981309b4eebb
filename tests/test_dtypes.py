"""dtypes: which float casts are exact."""

import pytest

from relay_amp.dtypes import widens_exactly


@pytest.mark.parametrize("narrow, wide, exact", [
    ("bfloat16", "float32", True), ("float16", "float32", True), ("float32", "float64", True),
    ("float32", "bfloat16", False),  # narrows
    ("float16", "bfloat16", False),  # same width, different ranges
    ("int8", "float32", False), ("bfloat16", "int32", False),  # not both floats
])
def test_a_float_widens_exactly_only_into_a_wider_float(narrow, wide, exact):
    assert widens_exactly(narrow, wide) is exact
