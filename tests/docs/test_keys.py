"""The documentation's requests, as one reader sends them: every page on one Redis, in
order. A page's first request under a key must be the request any other page sends first
under it (the same path and body): else the reader, following the site on one Redis, gets
422 where the page shows its first run. (A page may reuse its own key on purpose, to show
the 422.)"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
KEY = re.compile(r"Idempotency-Key: ([^'\"\s]+)")
PATH = re.compile(r"https?://[^/\s'\"]+(/[^\s'\"?]*)")
BODY = re.compile(r"(?:-d|--data|--json)\s+'([^']*)'")


def first_requests() -> dict[str, dict[tuple[str, str], list[str]]]:
    """Each key: the pages whose first request under it is each (path, body)."""
    found: dict[str, dict[tuple[str, str], list[str]]] = defaultdict(lambda: defaultdict(list))
    for page in PAGES:
        seen: set[str] = set()
        for line in page.read_text().splitlines():
            key = KEY.search(line)
            path = PATH.search(line)
            if "curl" not in line or key is None or path is None or key.group(1) in seen:
                continue
            seen.add(key.group(1))
            body = BODY.search(line)
            sent = (path.group(1), body.group(1) if body else "")
            found[key.group(1)][sent].append(str(page.relative_to(ROOT)))
    return found


def test_pages_never_start_a_key_with_different_requests() -> None:
    clashes = {
        key: {f"{path} {body}": pages for (path, body), pages in sent.items()}
        for key, sent in first_requests().items()
        if len(sent) > 1
    }
    assert not clashes, clashes


WHEEL = re.compile(r"goblin[_-]idem-(\d[^-\s`'\"]*)(?:-py3|\.tar\.gz)")


def test_the_files_the_pages_name_are_this_release() -> None:
    """A wheel or sdist named in the pages is the one a build of this checkout writes."""
    import goblin_idem

    named = {
        (str(page.relative_to(ROOT)), version)
        for page in PAGES
        for version in WHEEL.findall(page.read_text())
    }
    assert named, "no page names the wheel"
    assert {v for _, v in named} == {goblin_idem.__version__}, named
