"""The worked examples in sparsecore's docstrings stay true."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("module", ["sparsecore.config", "sparsecore.modules"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
