"""The ``fxtp`` command line (``fxtp``, ``python -m fxtp``): the parser (``main``), MODEL and
``--input`` (``inspection``), the built-in examples (``examples``), ``--verify`` (``verify``),
``fxtp demo`` (``demo``), the published configs' table (``families``) and the progress lines
(``progress``). Nothing below it imports it (tests/test_structure.py).

``main`` and ``get_args_parser`` load no torch: ``fxtp --help`` answers without it.
"""

from fxtp.cli.main import get_args_parser, main

__all__ = ["main", "get_args_parser"]
