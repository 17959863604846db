"""The `kvrag` command: `main` and `build_parser` (main.py), one module per command group beside them."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
