"""A model named by its Hugging Face hub id (`Qwen/Qwen3-30B-A3B`), found in the local hub cache
the way `huggingface_hub` lays it out, without a network and without that package:

    <cache>/models--Qwen--Qwen3-30B-A3B/refs/main            the commit `main` points at
    <cache>/models--Qwen--Qwen3-30B-A3B/snapshots/<commit>/   the files of that commit

<cache> is where `huggingface_hub` puts it: $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE (its older
name), else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub.
This module is the one place strata reads those variables. strata never downloads: a hub id not
in the cache is refused in one line that says how to fetch it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from strata.errors import FormatError

__all__ = ["hub_cache_dir", "looks_like_hub_id", "snapshot_dir"]

# owner/name as the hub spells repository ids: letters, digits, '-', '_', '.'; no '..', one '/'
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
MAIN_REF = "main"


def hub_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The hub cache directory `huggingface_hub` would use under `environ`."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(key):
            return Path(environ[key]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def looks_like_hub_id(name: str | os.PathLike) -> bool:
    """`owner/name` that is not an existing path (a path wins over a hub id: `out/tiny` where
    out/tiny.gguf is, too) nor a file name."""
    text = os.fspath(name)
    return (bool(_HUB_ID.match(text)) and ".." not in text and not os.path.exists(text)
            and not os.path.exists(text + ".gguf")
            and not text.lower().endswith((".gguf", ".experts", ".json", ".safetensors")))


def snapshot_dir(repo_id: str, environ: Mapping[str, str] = os.environ) -> Path:
    """The snapshot directory of `repo_id`'s `main` in the local cache; FormatError (one line,
    naming the cache and the command that fills it) when the cache does not hold it."""
    cache = hub_cache_dir(environ)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    fetch = f"fetch it with `hf download {repo_id}` (or `huggingface-cli download {repo_id}`), or give a path"
    if not repo.is_dir():
        raise FormatError(f"{repo_id}: not in the local Hugging Face cache ({cache}; set HF_HUB_CACHE or HF_HOME "
                          f"for another) and strata does not download: {fetch}")
    ref = repo / "refs" / MAIN_REF
    try:
        commit = ref.read_text(encoding="utf-8").strip()
    except OSError:
        raise FormatError(f"{repo_id}: the local Hugging Face cache ({repo}) has no refs/{MAIN_REF}: the download "
                          f"did not finish; {fetch}") from None
    snapshot = repo / "snapshots" / commit
    if not commit or not snapshot.is_dir():
        raise FormatError(f"{repo_id}: refs/{MAIN_REF} in {repo} names commit {commit!r}, whose snapshot is not "
                          f"there; {fetch}")
    return snapshot
