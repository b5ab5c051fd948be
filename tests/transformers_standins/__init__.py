"""Stand-ins for the three modules that transformers' ``tests/test_modeling_common.py`` and
``tests/test_configuration_common.py`` import but that its source distribution does not ship.

``tests/test_transformers_common.py`` fetches those two files from the sdist on the package index at test time
and installs these modules under the names the files import (``.exporters.test_export``,
``.generation.test_utils``, ``.utils.test_configuration_utils``). Each module says what it replaces and why.
"""
