"""Every relative link in README.md and docs/*.md resolves: `[text](path)` to a file or folder
of the repository, `[text](path#anchor)` and `[text](#anchor)` also to a heading of the target
markdown file. Web and mail links are not checked. Links inside code (fenced blocks, inline
backticks) are not links and are skipped."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) or [text](target "title"); text may hold one level of brackets or code.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def strip_code(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: inline markup reduced to its text, lowercased, every
    character but letters, digits, underscores, hyphens and spaces dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings; repeated headings get -1, -2, ... as on
    GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in _HEADING.findall(re.sub(_FENCE, "", path.read_text(encoding="utf-8"))):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return _LINK.findall(strip_code(path.read_text(encoding="utf-8")))


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of one markdown file that do not resolve inside `root`, each with
    the reason."""
    bad = []
    for target in links(path):
        if target.lower().startswith(_EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.is_relative_to(root):
            bad.append(f"{target}: points outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file {dest.relative_to(root)}")
        elif anchor and dest.suffix.lower() != ".md":
            bad.append(f"{target}: an anchor into a file that is not markdown")
        elif anchor and anchor not in anchors(dest):
            bad.append(f"{target}: {dest.relative_to(root)} has no heading #{anchor}")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert not broken_links(path), f"{path.relative_to(ROOT)}: " + "; ".join(broken_links(path))


def test_readme_links_to_the_docs() -> None:
    """The README's docs index links every file of docs/ (so this test has links to check)."""
    targets = {t.partition("#")[0] for t in links(ROOT / "README.md")}
    missing = [p.name for p in DOCS[1:] if f"docs/{p.name}" not in targets]
    assert not missing, f"README.md does not link {missing}"


def test_slug_and_checker_catch_mistakes(tmp_path: Path) -> None:
    """The rule itself: GitHub's slugs, and a broken file or anchor is reported."""
    assert slug("Export: `deepseek_mtp`") == "export-deepseek_mtp"
    assert slug("bench_spec.py") == "bench_specpy"
    assert slug("Where it stands") == "where-it-stands"
    assert slug("The [engine](x.md) (CPU)") == "the-engine-cpu"
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Title\n\n## Part one\n\n## Part one\n")
    doc.write_text("[ok](b.md#part-one-1) [bad](b.md#part-two) [gone](c.md) `[code](c.md)`\n"
                   "[web](https://example.com) [self](#top) [out](../x.md)\n\n# Top\n")
    bad = broken_links(doc, root=tmp_path)
    assert [b.split(":")[0] for b in bad] == ["b.md#part-two", "c.md", "../x.md"]
