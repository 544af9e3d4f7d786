"""The test suite, a package: ``tests.conftest``, ``tests.fakes`` and the shared helpers are one
module each under one name. (Without this file pytest imported ``tests/conftest.py`` twice, as
``conftest`` for its fixtures and as ``tests.conftest`` for the files that import its ``Clip``
or ``Server``: two classes of each name.) mypy checks it as ``tests.*`` (scripts/test)."""
