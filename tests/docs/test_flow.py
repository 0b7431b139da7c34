"""The landing page's picture (docs/img/flow.svg) stays true: every name it shows exists."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree

from tests.support.procs import ROOT

SVG = ROOT / "docs" / "img" / "flow.svg"
NS = "{http://www.w3.org/2000/svg}"
EXAMPLE_KEY = "k1"  # the key the picture's client sends


def sources() -> str:
    """The package's and the example app's code, where every name the picture uses lives."""
    files = [*(ROOT / "goblin_idem").rglob("*.py"), *(ROOT / "goblin_idem").rglob("*.c")]
    files += (ROOT / "example_app").rglob("*.py")
    return "\n".join(f.read_text() for f in files).lower()


def names() -> set[str]:
    """Names in code type, and the dotted or hyphenated ones (GOBLIN.CAEXPIRE, key-reused)
    in the notes; numbers, and the words of the sentences around them, are left out."""
    found: set[str] = set()
    for text in ElementTree.parse(SVG).getroot().iter(f"{NS}text"):
        words = re.findall(r"[A-Za-z_/][\w./-]*\w", text.text or "")
        if text.get("class") == "code":
            found |= set(words)
        else:
            found |= {w for w in words if re.search(r"[.-]", w) or w.isupper()}
    return found - {EXAMPLE_KEY}


def test_the_page_shows_the_picture() -> None:
    assert "](img/flow.svg)" in (ROOT / "docs" / "index.md").read_text()


def test_every_name_in_the_picture_exists() -> None:
    code = sources()
    shown = names()
    assert {"GOBLIN.CLAIM", "GOBLIN.CAEXPIRE", "Idempotency-Key", "key-reused"} <= shown
    missing = sorted(n for n in shown if n.lower() not in code)
    assert not missing, f"docs/img/flow.svg names what the code does not: {missing}"
