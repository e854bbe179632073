"""Running HF transformers' kernel-hub path with the `kernels` library this machine's index has.

transformers 5.23 and 5.24 accept only kernels >= 0.18.2, < 0.19; the newest kernels our package index has is 0.17.2,
and transformers 5.20-5.22 accept exactly that (their hub_kernels.py differs from 5.23's only in the versions of the hub
repositories it names, not in the kernels API it calls). transformers decides at import whether to use kernels (its
decorators are identities otherwise), so this must run before any transformers modeling code is imported."""
from __future__ import annotations

from typing import Optional


def accept_installed_kernels() -> Optional[str]:
    """Make transformers use the installed `kernels` when it is older than the version transformers pins. Returns why
    (None when transformers accepts it as installed, and nothing is changed)."""
    import importlib.metadata
    import sys

    import transformers
    import transformers.utils as utils
    from packaging import version
    import transformers.utils.import_utils as import_utils

    if import_utils.is_kernels_available():
        return None
    loaded = [m for m in ("transformers.integrations.hub_kernels", "transformers.modeling_utils") if m in sys.modules]
    if loaded:
        raise RuntimeError(f"call accept_installed_kernels() before transformers imports {loaded}")
    installed, minimum = importlib.metadata.version("kernels"), import_utils.KERNELS_MIN_VERSION
    if not version.parse(installed) < version.parse(minimum):
        raise RuntimeError(f"kernels {installed} is not older than transformers' minimum {minimum}")
    utils.is_kernels_available = import_utils.is_kernels_available = lambda *args, **kwargs: True
    return (f"transformers {transformers.__version__} pins kernels >= {minimum}; using the installed kernels "
            f"{installed} (the API its hub code calls is unchanged)")
