"""Kiln's Python SDK: ``from kiln import Client``. Standard library only (Python 3.9+)."""

from .client import Client
from .errors import KilnError
from . import webhooks

__all__ = ["Client", "KilnError", "webhooks"]
__version__ = "0.1.0"
