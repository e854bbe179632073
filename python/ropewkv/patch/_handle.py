"""The undo handle shared by every patch."""
from __future__ import annotations

import warnings
from typing import Any

ALREADY_PATCHED = ("already patched by another active ropewkv handle, whose settings stay in force; undo that handle "
                   "first to patch it with other settings")


class PatchHandle:
    """What a patch replaced, and how to put it back.

    Attributes:
        patched: "module.attribute" names now bound to ropewkv functions, in patch order.
        skipped: {what: why} for candidates left alone (not importable, incompatible semantics, no such model, already
            patched by another handle).
    Use `handle.undo()`, or the handle as a context manager (`with ropewkv.patch.transformers(): ...`). Undo restores
    the original objects themselves (identity). An attribute another handle has patched is skipped, never re-wrapped,
    so handles can be undone in any order and every attribute ends up with its original.
    """

    def __init__(self):
        self.patched: list[str] = []
        self.skipped: dict[str, str] = {}
        self._saved: list[tuple[Any, str, Any, Any]] = []

    @staticmethod
    def _name(owner: Any, attribute: str) -> str:
        if isinstance(owner, type):
            return f"{owner.__module__}.{owner.__qualname__}.{attribute}"
        return f"{getattr(owner, '__name__', owner)}.{attribute}"

    def _taken(self, owner: Any, attribute: str, replacement: Any = None) -> bool:
        """True (recorded in skipped) if owner.attribute is already a ropewkv replacement: `replacement` itself, or a
        function marked `_ropewkv`."""
        current = getattr(owner, attribute, None)
        if current is None or not (current is replacement or getattr(current, "_ropewkv", False)):
            return False
        self.skipped[self._name(owner, attribute)] = ALREADY_PATCHED
        return True

    def _replace(self, owner: Any, attribute: str, replacement: Any) -> None:
        self._saved.append((owner, attribute, getattr(owner, attribute), replacement))
        setattr(owner, attribute, replacement)
        self.patched.append(self._name(owner, attribute))

    def undo(self) -> None:
        """Restore every attribute that still holds this handle's replacement (idempotent). One rebound since by
        someone else is left as it is, with a warning: restoring ours would undo theirs."""
        while self._saved:
            owner, attribute, original, replacement = self._saved.pop()
            if getattr(owner, attribute) is replacement:
                setattr(owner, attribute, original)
            else:
                warnings.warn(f"{self._name(owner, attribute)} was rebound after ropewkv patched it; left as it is, "
                              f"its original not restored", RuntimeWarning, stacklevel=2)
        self.patched.clear()

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"PatchHandle(patched={self.patched}, skipped={self.skipped})"
