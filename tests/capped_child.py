"""Runs a script in a child Python capped with RLIMIT_AS and collects what it reports:
one JSON object per input path on stdout. The hostile-input tests use it so a parser that
tries a huge allocation fails in the child, and a crash names the input it died at."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_capped(script: str, args: list[str], paths: list[Path], timeout: float) -> dict[str, dict[str, Any]]:
    """path -> the record the child printed for it ({"path": ..., ...} lines); every path
    must have one, else the child died and the assertion says where."""
    proc = subprocess.run([sys.executable, "-c", script, *args, *map(str, paths)],
                          capture_output=True, text=True, timeout=timeout)
    got = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            got[rec.pop("path")] = rec
    missing = [str(p) for p in paths if str(p) not in got]
    assert not missing, f"child died (rc {proc.returncode}) at {missing[0]}: {proc.stderr[-2000:]}"
    return got
