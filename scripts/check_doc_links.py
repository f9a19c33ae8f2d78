"""Every relative link in the given Markdown files (or folders of them) leads somewhere:
the file or folder exists and, for a link into a Markdown file, the #anchor is one of its
headings (as GitHub names them) or an explicit <a id="...">.

    .venv/bin/python scripts/check_doc_links.py README.md docs

Exits 1 naming each broken link by file and line."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

LINK = re.compile(r"!?\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, re.sub(r"`[^`]*`", lambda m: "`" + "x" * (len(m.group()) - 2) + "`", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).replace("`", "").strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    lines = text.splitlines()
    found: set[str] = set(ANCHOR.findall(text))
    counts: dict[str, int] = {}
    for number, line in _prose(text):
        if HEADING.match(line):
            base = slug(HEADING.match(lines[number - 1]).group(2))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken(path: Path) -> Iterator[str]:
    text = path.read_text()
    for number, line in _prose(text):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path.resolve()
            if not dest.exists():
                yield f"{path}:{number}: {target}: no such file"
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                yield f"{path}:{number}: {target}: no anchor #{anchor} in {dest.name}"


def main(args: list[str]) -> int:
    files = [f for a in map(Path, args) for f in (sorted(a.rglob("*.md")) if a.is_dir() else [a])]
    problems = [p for f in files for p in broken(f)]
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"{len(problems)} broken link(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
