"""The web console's files (``static/``: hand-written HTML, CSS and ES modules, no build
step), shipped as package data; gateway/http/console.py serves them."""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable

STATIC: Traversable = files(__name__) / "static"
