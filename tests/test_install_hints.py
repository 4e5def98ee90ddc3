"""Every install hint names the distribution ellm is published as.

`import ellm` is installed by the distribution "ellm-engine": the name "ellm" on the
package index belongs to an unrelated project, so a hint such as `pip install
'ellm[server]'` would fetch that one on a fresh machine. The hints are read from the
installed package's own files (so this also runs against a wheel) and from the docs
when the source tree is here.
"""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import ellm

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = importlib.metadata.distribution("ellm-engine").metadata.get_all("Provides-Extra") or []
# `ellm[<an extra>]`, `pip install ellm`, `llm install ellm` (the llm CLI's plugin install,
# a pip install underneath) or `--no-binary ellm` where "ellm" stands alone
# (not ellm-engine, not a path such as ellm/ or a module such as ellm.cli).
WRONG_NAME = re.compile(rf"(?<![\w./-])ellm\[(?:{'|'.join(map(re.escape, EXTRAS))})[],]"
                        r"|(?:pip|llm) install ellm(?![\w.\[/-])|--no-binary ellm(?![\w.\[/-])")


def hint_files() -> list[Path]:
    files = sorted(Path(ellm.__file__).resolve().parent.rglob("*.py"))
    for folder in ("docs", "wheels", "benchmarks"):
        files += sorted((ROOT / folder).rglob("*.md")) + sorted((ROOT / folder).rglob("*.py"))
    if (ROOT / "README.md").is_file():
        files.append(ROOT / "README.md")
    return files


def test_the_distribution_is_ellm_engine() -> None:
    """The installed metadata is ellm-engine's, and its script runs this package's CLI."""
    dist = importlib.metadata.distribution("ellm-engine")
    assert dist.version == ellm.__version__
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts == {"ellm": "ellm.cli:main"}


def test_every_install_hint_names_the_distribution() -> None:
    wrong = [f"{path}:{n}: {line.strip()}"
             for path in hint_files()
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if WRONG_NAME.search(line)]
    assert not wrong, ("install hints naming 'ellm' (another project on the index), not 'ellm-engine':\n"
                       + "\n".join(wrong))


def test_the_pattern_tells_the_names_apart() -> None:
    for bad in ["pip install 'ellm[server]'", "extra `ellm[ray]`", "pip install ellm", "--no-binary ellm ellm",
                "pip install 'ellm[server,hub]'", 'pip install "ellm[langchain]"', "llm install ellm"]:
        assert WRONG_NAME.search(bad), bad
    for good in ["pip install 'ellm-engine[server]'", "pip install ellm-engine", "--no-binary ellm-engine ellm-engine",
                 "python -m ellm info", "src/ellm[0]", "import ellm", "ellm.cli:main", "a, b = ellm[key], ref[key]",
                 "llm install ellm-engine"]:
        assert not WRONG_NAME.search(good), good
