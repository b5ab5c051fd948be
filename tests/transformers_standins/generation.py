"""Stand-in for transformers' ``tests/generation/test_utils.py`` (not in the sdist).

The real module holds ``GenerationTesterMixin``, the tests of ``generate()``. ``ModelTesterMixin`` only uses the
class in an ``issubclass`` check: a tester must inherit from it exactly when its model can generate. NeoBERT is
an encoder and cannot generate, so the tester does not inherit from it and an empty class is all the check needs.
"""


class GenerationTesterMixin:
    """Empty: encoders have no ``generate()`` to test."""
