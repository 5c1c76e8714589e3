"""A llama.cpp GGUF split into parts (`name-00001-of-00003.gguf`, ...: llama.cpp's `gguf-split`
and the `gguf` package's writer with split_max_tensors / split_max_size) read as one file.

The first part holds the model's metadata and `split.count` (how many parts), `split.no` (0) and
`split.tensors.count` (the tensors of all parts); every part carries its `split.no` and the same
count. Each part is opened and checked by strata's GGUF reader (strata/formats/gguf_file.py); a
missing part, a part of another split (its number or count not the one its name says), a tensor
in two parts, or a tensor count other than the first part's is one FormatError line naming it.
A file without `split.count` (or with 1) is returned as it is."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from strata.errors import FormatError
from strata.formats.gguf_file import GGUFFile, TensorInfo, open_gguf

SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS = "split.count", "split.no", "split.tensors.count"
PART_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class SplitGGUF:
    """The parts of a split GGUF as one `GGUFFile`-like reader: the first part's `fields`, every
    part's `tensors` (in part order), `raw(info)` from the part that holds it."""

    def __init__(self, parts: list[GGUFFile]) -> None:
        self.parts = parts
        self.path, self.fields = parts[0].path, parts[0].fields
        self.tensors: dict[str, TensorInfo] = {}
        self._part_of: dict[str, GGUFFile] = {}
        for part in parts:
            for name, info in part.tensors.items():
                if name in self.tensors:
                    raise FormatError(f"{part.path}: tensor {name} is also in {self._part_of[name].path}")
                self.tensors[name] = info
                self._part_of[name] = part

    def raw(self, info: TensorInfo) -> np.ndarray:
        return self._part_of[info.name].raw(info)

    def location(self, info: TensorInfo) -> tuple[str, int]:
        return self._part_of[info.name].location(info)

    @property
    def files(self) -> tuple[tuple[str, int], ...]:
        return tuple(f for part in self.parts for f in part.files)

    def close(self) -> None:
        for part in self.parts:
            part.close()


def _integer(f: GGUFFile, key: str) -> int | None:
    field = f.fields.get(key)
    if field is None:
        return None
    if isinstance(field.value, bool) or not isinstance(field.value, (int, np.integer)) or field.value < 0:
        raise FormatError(f"{f.path}: metadata key {key} is {field.type_name} {field.value!r}, expected an integer")
    return int(field.value)


def open_split(path: str | Path) -> GGUFFile | SplitGGUF:
    """`path` opened and checked; where it is the first part of a split GGUF, every part with it."""
    first = open_gguf(path)
    count = _integer(first, SPLIT_COUNT)
    if count is None or count <= 1:
        return first
    opened = [first]
    try:
        name = PART_NAME.match(Path(path).name)
        no = _integer(first, SPLIT_NO)
        if no != 0 or name is None or int(name["no"]) != 1:
            want = f"{name['stem']}-00001-of-{name['count']}.gguf" if name else "the part named -00001-of-"
            raise FormatError(f"{path}: part {0 if no is None else no + 1} of a {count}-part split GGUF; "
                              f"give the first part ({want})")
        if int(name["count"]) != count:
            raise FormatError(f"{path}: {SPLIT_COUNT} = {count}, but the name says {int(name['count'])} parts")
        for i in range(1, count):
            part_path = Path(path).with_name(f"{name['stem']}-{i + 1:05d}-of-{count:05d}.gguf")
            if not part_path.is_file():
                raise FormatError(f"{path}: part {i + 1} of {count} is missing ({part_path.name} not found beside it)")
            part = open_gguf(part_path)
            opened.append(part)
            if _integer(part, SPLIT_NO) != i or _integer(part, SPLIT_COUNT) != count:
                raise FormatError(f"{part_path}: {SPLIT_NO} = {_integer(part, SPLIT_NO)}, {SPLIT_COUNT} = "
                                  f"{_integer(part, SPLIT_COUNT)}; expected {i} and {count} (a part of another split?)")
        split = SplitGGUF(opened)
        want_tensors = _integer(first, SPLIT_TENSORS)
        if want_tensors is not None and want_tensors != len(split.tensors):
            raise FormatError(f"{path}: {SPLIT_TENSORS} = {want_tensors}, but the {count} parts hold "
                              f"{len(split.tensors)} tensors")
        return split
    except BaseException:
        for f in opened:
            f.close()
        raise
