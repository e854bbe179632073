"""The undo handle shared by every patch."""
from __future__ import annotations

from typing import Any


class PatchHandle:
    """What a patch replaced, and how to put it back.

    Attributes:
        patched: "module.attribute" names now bound to ropewkv functions, in patch order.
        skipped: {what: why} for candidates left alone (not importable, incompatible semantics, no such model).
    Use `handle.undo()`, or the handle as a context manager (`with ropewkv.patch.transformers(): ...`). Undo restores
    the original objects themselves (identity), in reverse order, so nested patches unwind correctly.
    """

    def __init__(self):
        self.patched: list[str] = []
        self.skipped: dict[str, str] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def _replace(self, owner: Any, attribute: str, replacement: Any) -> None:
        self._saved.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, replacement)
        is_class = isinstance(owner, type)
        name = f"{owner.__module__}.{owner.__qualname__}" if is_class else getattr(owner, "__name__", owner)
        self.patched.append(f"{name}.{attribute}")

    def undo(self) -> None:
        """Restore every replaced attribute (idempotent)."""
        while self._saved:
            owner, attribute, original = self._saved.pop()
            setattr(owner, attribute, original)
        self.patched.clear()

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"PatchHandle(patched={self.patched}, skipped={self.skipped})"
