"""The documentation site builds, strictly, and the README stays a front page.

`mkdocs build --strict` fails on a page missing from the navigation, a link to a page
or anchor that does not exist, and any other warning. The examples on the pages are run
by tests/test_readme.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("index.html", "getting-started/index.html", "delivery/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_the_readme_is_a_front_page() -> None:
    """At most ~250 lines: what and why, install, the two commands, a tour, links. The
    reference lives in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    first_block = README.read_text().split("```")[1]
    commands = [line for line in first_block.splitlines()[1:] if line.strip()]
    assert [c.split("#")[0].strip() for c in commands] == ["./run demo", "./run test"]


def test_the_readmes_links_to_the_docs_exist() -> None:
    """GitHub renders README links to docs/ as files: each must be there."""
    targets = re.findall(r"\]\((docs/[^)#]+)", README.read_text())
    assert targets
    missing = [t for t in targets if not (ROOT / t).is_file()]
    assert not missing, missing
