"""`kvferry demo`: the whole stack on one machine (stack bring-up, traffic, live view, CLI)."""

from kvferry.local.demo.cli import main

__all__ = ["main"]
