"""The peak memory of one `strata convert`, measured in a fresh Python (the memory tests of the
converter: tests/convert/test_convert_streaming.py, tests/convert/test_convert_qwen4_tables_memory.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Imports first, then reset the kernel's high-water mark (writing 5 to /proc/self/clear_refs
# resets VmHWM), convert, and read VmHWM against the VmRSS the conversion started from. Prints
# "start peak" in bytes.
RSS_SCRIPT = """
import sys
from strata.cli.main import main
import gguf, tqdm, strata.convert, strata.cli.convert

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
start = status("VmRSS")
rc = main(["convert", *sys.argv[1:], "--quiet"])
assert rc == 0, rc
print(start, status("VmHWM"))
"""


def convert_rss(*args: str, timeout: float | None = None) -> tuple[int, int]:
    """`strata convert ARGS --quiet` in a fresh Python -> (VmRSS when the conversion started,
    VmHWM after it) in bytes. Linux only (/proc/self/clear_refs)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", RSS_SCRIPT, *args], capture_output=True, text=True, env=env, cwd=REPO,
                       check=False, timeout=timeout)
    assert r.returncode == 0, r.stderr
    start, peak = r.stdout.split()[-2:]
    return int(start), int(peak)
