"""Drop-in replacements with other libraries' argument orders and conventions (compat.fla: flash-linear-attention)."""
from . import fla

__all__ = ["fla"]
