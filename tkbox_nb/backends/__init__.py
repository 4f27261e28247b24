"""Box backends: one module per backend behind the interface in base.py."""

from .base import Backend, BoxSpec, get_backend, BACKENDS  # noqa: F401
