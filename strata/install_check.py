"""Is this `strata` package ours (the distribution strata-moe), alone in its directory?

Two unrelated distributions also install an import package named `strata`: `strata` (a
configuration framework) and `amperor-strata` (another expert-paging runtime, with its own
`strata` command). Installed into the same site-packages, their files and ours overwrite each
other (`strata/config.py`, `strata/errors.py`, `strata/cli/`). The check costs one directory
listing: a foreign `*.dist-info` beside our package directory means the files are mixed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

DISTRIBUTION = "strata-moe"
OUR_SUMMARY = "Run Mixture-of-Experts language models larger than memory"  # pyproject's description
FOREIGN = ("strata-*.dist-info", "amperor_strata-*.dist-info")


class PackageConflictWarning(UserWarning):
    """Another distribution's `strata` package shares this one's directory."""


def foreign_distributions(package_dir: Path) -> list[str]:
    """Names of the other `strata` distributions installed beside `package_dir`. Our own old
    installs (distribution name `strata`, before the rename) are recognised by their summary."""
    found = []
    for pattern in FOREIGN:
        for info in package_dir.parent.glob(pattern):
            meta = info / "METADATA"
            try:
                ours = OUR_SUMMARY in meta.read_text(encoding="utf-8", errors="replace")[:4096]
            except OSError:
                ours = False
            if not ours:
                found.append(info.name.split("-")[0].replace("_", "-"))
    return sorted(set(found))


def conflict_message(names: list[str], package_dir: Path) -> str:
    return (f"{package_dir}: the `strata` package of {DISTRIBUTION} shares its directory with "
            f"{', '.join(names)} (an unrelated project with the same import name); their files overwrite each "
            f"other. Fix: pip uninstall -y {' '.join(names)} {DISTRIBUTION} && pip install {DISTRIBUTION}")


def check_install(package_dir: Path) -> None:
    names = foreign_distributions(package_dir)
    if names:
        warnings.warn(conflict_message(names, package_dir), PackageConflictWarning, stacklevel=3)
