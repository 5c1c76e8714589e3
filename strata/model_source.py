"""What a model path names, checked before loading: a strata model (NAME.gguf beside NAME.experts)
or something to convert first. Stat calls and at most one GGUF header read, so a wrong path fails
at once with the command that fixes it instead of "no such experts file"."""

from __future__ import annotations

import re
import stat
import struct
from pathlib import Path

from strata.errors import FormatError
from strata.hub_cache import looks_like_hub_id, snapshot_dir

__all__ = ["check_model_source", "gguf_architecture", "is_llama_cpp_gguf", "resolve_model_name", "strata_model_in", "WEIGHT_SUFFIXES"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".npz", ".mlx")
GGUF_MAGIC = b"GGUF"
ARCH_KEY = b"general.architecture"
GGUF_STRING = 8  # GGUF's value type id of a string
MAX_ARCH_BYTES = 256  # an architecture name; anything longer is not one


def _convert_hint(src: Path | str) -> str:
    return f"run `strata convert {src} OUT`, then `strata generate OUT.gguf PROMPT`"


def gguf_architecture(path: Path) -> str | None:
    """`general.architecture` of a GGUF file when it is the first metadata key (gguf writers put
    it there, strata's and llama.cpp's alike); None when the file is not GGUF or has it elsewhere."""
    try:
        with open(path, "rb") as f:
            head = f.read(4 + 4 + 8 + 8 + 8 + len(ARCH_KEY) + 4 + 8)
            if len(head) < 24 or head[:4] != GGUF_MAGIC:
                return None
            (key_len,) = struct.unpack_from("<Q", head, 24)
            if key_len != len(ARCH_KEY) or head[32:32 + key_len] != ARCH_KEY:
                return None
            vtype, value_len = struct.unpack_from("<IQ", head, 32 + key_len)
            if vtype != GGUF_STRING or value_len > MAX_ARCH_BYTES:
                return None
            return f.read(value_len).decode("utf-8", errors="replace")
    except (OSError, struct.error):
        return None


def check_model_source(path: Path) -> None:
    """Raise a one-line FormatError when `path` (which exists) is not a strata model file:
    a directory (a Hugging Face checkpoint or not), a weights file, or something that is not a
    regular file (a named pipe would block the reader). A llama.cpp GGUF passes: it runs in place
    (`is_llama_cpp_gguf`)."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise FormatError(f"{path}: cannot open: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        if (path / "config.json").exists():
            raise FormatError(f"{path}: a Hugging Face checkpoint directory, not a strata model; {_convert_hint(path)}")
        raise FormatError(f"{path}: a directory, not a strata model (NAME.gguf beside NAME.experts, "
                          f"written by `strata convert SRC OUT`)")
    if not stat.S_ISREG(mode):
        raise FormatError(f"{path}: not a regular file (a pipe or a device); a strata model is NAME.gguf beside NAME.experts")
    if path.suffix.lower() in WEIGHT_SUFFIXES:
        raise FormatError(f"{path}: a {path.suffix} weights file, not a strata model; "
                          f"{_convert_hint(path.parent)} (the checkpoint's directory)")


SPLIT_PART = re.compile(r"^.+-\d{5}-of-\d{5}\.gguf$")  # llama.cpp's gguf-split part names


def is_llama_cpp_gguf(path: Path) -> bool:
    """A GGUF that is not a strata model file: llama.cpp's (its `general.architecture` names its
    family), or a part of a split one (later parts carry no architecture). Runs in place."""
    from strata.formats.model_file import ARCHITECTURE

    arch = gguf_architecture(path)
    if arch is not None:
        return arch != ARCHITECTURE
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError:
        return False
    return magic == GGUF_MAGIC and SPLIT_PART.match(path.name) is not None


EMBEDDED_NAME = "default"  # names the embedded model wherever a model is named (where no such file is)


def resolve_model_name(name: str | Path) -> Path:
    """What a model argument names, as a path: an existing path as it is; `default` (where no file
    `default` or `default.gguf` is) the embedded model; a hub id `owner/name` (where no such path
    is) its snapshot directory in the local Hugging Face cache (strata/hub_cache.py); anything else
    the path as given (for the caller to refuse)."""
    text = str(name)
    if text == EMBEDDED_NAME and not Path(text).exists() and not Path(text + ".gguf").exists():
        from strata.default_model import default_model_path

        return default_model_path()
    if looks_like_hub_id(text):
        return snapshot_dir(text)
    return Path(name)


def strata_model_in(directory: Path, named_as: str) -> Path:
    """The strata model (NAME.gguf with NAME.experts beside it) a directory holds, such as a hub
    snapshot; refused in one line when it holds none (a checkpoint to convert) or several."""
    found = sorted(p for p in directory.glob("*.gguf") if p.with_suffix(".experts").exists())
    if len(found) == 1:
        return found[0]
    if found:
        raise FormatError(f"{named_as}: {directory} holds {len(found)} strata models; name one: {found[0]}")
    if (directory / "config.json").exists():
        raise FormatError(f"{named_as}: a Hugging Face checkpoint ({directory}), not a strata model; "
                          f"run `strata convert {named_as} OUT`, then `strata generate OUT.gguf PROMPT`")
    raise FormatError(f"{named_as}: {directory} holds no strata model (NAME.gguf beside NAME.experts)")
