"""`tests.deferred_import`: a test dependency is imported on the first read of a public name, not while pytest
collects (pytest reads `_`-names of every module-level object then), and a missing one fails at once naming the
test extra."""

import sys

import pytest

from tests.deferred_import import deferred_import


def test_a_deferred_module_is_imported_on_its_first_public_name_and_not_on_private_ones(monkeypatch):
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)  # a small standard module, imported afresh
    colorsys = deferred_import("colorsys", "a test needs it")
    for private in ("__test__", "_pytestfixturefunction"):  # what pytest reads while collecting
        with pytest.raises(AttributeError):
            getattr(colorsys, private)
    assert "colorsys" not in sys.modules
    assert colorsys.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
    assert "colorsys" in sys.modules


def test_a_missing_module_fails_at_once_naming_the_test_extra():
    with pytest.raises(ImportError, match=r"the endpoint needs it, in the test extra: pip install -e '\.\[test\]'"):
        deferred_import("no_such_package_for_stacx_tests", "the endpoint needs it")
