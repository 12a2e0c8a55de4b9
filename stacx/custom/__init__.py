"""User algorithms: drop a module in this folder and its `@register_*` decorators run.

Every module here is imported automatically (with every module of `stacx.objectives`) before
the first registry lookup; see `stacx.plugins.discovery`. Files elsewhere are loaded with
`--custom-module path/to/my_algo.py` (repeatable). Example: examples/custom_algorithm/my_algo.py.
"""
