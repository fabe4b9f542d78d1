"""The test suite, a package so that its modules import their helpers as `tests.support.*` under
`pytest tests`, `python -m pytest` and xdist's processes alike (pytest puts the repository root, the
first directory above without an __init__.py, on sys.path)."""
import pytest

# The helpers' asserts explain their failures as a test's own do (pytest rewrites only test modules
# and conftest files unless told).
pytest.register_assert_rewrite("tests.support")
