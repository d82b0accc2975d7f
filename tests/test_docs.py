"""The repo explains itself: every docs/ reference in code, scripts and docs resolves (file and § section),
every relative link between markdown files resolves, and nothing points outside the repo."""

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = os.path.join("..", "shared")  # the development checkout's sibling folder, which a user's clone lacks


def sources():
    paths = []
    for pattern in ("*.md", "*.sh", "*.toml", "docs/*.md", "runs/*.sh", "nanochat/*.py", "nag/*.py", "scripts/*.py", "analysis/*.py"):
        paths += glob.glob(os.path.join(REPO, pattern))
    assert len(paths) > 20
    return sorted(paths)


def sections(md_path):
    """The numbers of a markdown file's '## N.' sections."""
    return {m for m in re.findall(r"^## (\d+)\.", open(md_path).read(), re.M)}


def test_docs_references_resolve():
    checked = 0
    for path in sources():
        text = open(path).read()
        for name, section in re.findall(r"docs/([\w.-]+\.md)(?:\s*§\s*(\d+))?", text):
            target = os.path.join(REPO, "docs", name)
            assert os.path.exists(target), f"{os.path.relpath(path, REPO)} cites docs/{name}, which does not exist"
            if section:
                assert section in sections(target), f"{os.path.relpath(path, REPO)} cites docs/{name} §{section}: no such section"
            checked += 1
    assert checked > 10


def test_markdown_links_resolve():
    for path in glob.glob(os.path.join(REPO, "*.md")) + glob.glob(os.path.join(REPO, "docs", "*.md")):
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", open(path).read()):
            if link.startswith(("http://", "https://")):
                continue
            target = os.path.normpath(os.path.join(os.path.dirname(path), link))
            assert os.path.exists(target), f"{os.path.relpath(path, REPO)} links {link}, which does not exist"


def test_nothing_points_outside_the_repo():
    for path in sources():
        text = open(path).read()
        assert OUTSIDE not in text and "DESIGN.md" not in text, os.path.relpath(path, REPO)
