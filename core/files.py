"""File modes for what infer writes: the user's umask, as `open` and `mkdir` would give."""
from __future__ import annotations

import os
from pathlib import Path


def chmod_as_umask(path: Path) -> None:
    """Give ``path`` the mode a plain ``mkdir``/``open`` would: safetensors writes files 0600 and ``mkdtemp``
    makes folders 0700, which a server running as another user cannot read."""
    mask = os.umask(0o077)  # reading the umask sets it: briefly to the strictest value, never a looser one
    os.umask(mask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
