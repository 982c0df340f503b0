"""The README and docs/ point only at what is there: every relative Markdown link names an existing file (and, with
`#anchor`, one of its headings), every repository path in a code span exists, every `README, "Section"`-style
reference in the user-facing files names a section that exists, and nothing cites a file outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Files a user reads that point into the README and docs by section name (the config schema's descriptions, the
# example configs, the workflow's messages).
REFERRERS = [*DOCS, *sorted((REPO / "config").glob("*.yaml")), *sorted((REPO / "workflow").rglob("*.smk")),
             *sorted((REPO / "workflow").rglob("*.yaml"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TOP_LEVEL = ("docs", "bench", "config", "scripts", "src", "tests", "workflow", "profiles", "envs", "data", ".ci")
# Paths the docs name that a user makes, not the repository: inputs you provide.
USER_MADE = {"data/gsm8k/test.jsonl"}
SECTION_REF = re.compile(r"(README(?:\.md)?|(?:docs|bench)/[A-Za-z_]+\.md)`?(?:'s|,)\s+(?:section\s+)?\\?\"([^\"\\]+)\\?\"")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def sections(path: Path) -> list[str]:
    """The headings of a Markdown file (outside code blocks) and its bold paragraph labels (`**The model store.**`)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    found = [m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", text, re.M)]
    found += [m.group(1).strip() for m in re.finditer(r"^\*\*([^*]+?)\.?\*\*", text, re.M)]
    return found


def test_every_relative_link_names_an_existing_file_and_heading():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                broken.append(f"{doc.name}: {target} (outside the repository)")
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists() or REPO not in (path, *path.parents):
                broken.append(f"{doc.name}: {target} (no such file in the repository)")
            elif anchor and anchor not in {slug(s) for s in sections(path)}:
                broken.append(f"{doc.name}: {target} (no heading #{anchor} in {path.name})")
    assert not broken, broken


def test_the_results_index_links_to_sections_that_exist():
    """bench/RESULTS.md's current figures and index link every section, here or in its archive, by its heading."""
    results = REPO / "bench" / "RESULTS.md"
    broken, targets = [], []
    for doc in (results, REPO / "bench" / "RESULTS_ARCHIVE.md"):
        for target in LINK.findall(doc.read_text()):
            file, _, anchor = target.partition("#")
            path = (doc.parent / file) if file else doc
            targets.append((path.name, anchor))
            if not path.exists() or (anchor and anchor not in {slug(s) for s in sections(path)}):
                broken.append(f"{doc.name}: {target}")
    assert not broken, broken
    # every section of both files is in the index (the files' own title and front parts aside)
    front = ("Measurements", "Current figures", "Index, newest first", "Superseded measurements")
    for doc in (results, REPO / "bench" / "RESULTS_ARCHIVE.md"):
        linked = {anchor for name, anchor in targets if name == doc.name}
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        headings = [m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", text, re.M)]
        unlisted = [h for h in headings if h not in front and slug(h) not in linked]
        assert not unlisted, (doc.name, unlisted)


def test_every_repository_path_in_a_code_span_exists():
    missing = []
    for doc in DOCS:
        for span in re.findall(r"`([^`\n]+)`", doc.read_text()):
            if span.split("/")[0] in TOP_LEVEL and not re.search(r"[<>*{}\[\] ]|\.\.\.|…", span) \
                    and span not in USER_MADE and not (REPO / span).exists():
                missing.append(f"{doc.name}: {span}")
    assert not missing, missing


def test_every_section_reference_names_a_section_that_exists():
    broken = []
    for referrer in REFERRERS:
        text = " ".join(referrer.read_text().split())  # a reference wrapped over two lines is one
        for target, section in SECTION_REF.findall(text):
            path = REPO / ("README.md" if target.startswith("README") else target)
            if not any(s.lower().startswith(section.lower().rstrip(".")) for s in sections(path)):
                broken.append(f"{referrer.relative_to(REPO)}: {target}, \"{section}\"")
    assert not broken, broken


def test_nothing_cites_a_file_outside_the_repository():
    for doc in DOCS:
        assert not re.search(r"\.\./shared|/work/", doc.read_text()), doc.name
