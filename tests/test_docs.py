"""The repo explains itself: every docs/ reference and markdown link resolves, inside the repo.

Every docs/ reference in code, scripts and docs resolves (file and § section),
every relative link between markdown files resolves, and nothing points outside the repo."""

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = os.path.join("..", "shared")  # the development checkout's sibling folder, which a user's clone lacks


def sources():
    paths = []
    for pattern in (
        "*.md",
        "*.sh",
        "*.toml",
        "docs/*.md",
        "runs/*.sh",
        "nanochat/*.py",
        "nag/*.py",
        "scripts/*.py",
        "analysis/*.py",
    ):
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
                assert section in sections(target), (
                    f"{os.path.relpath(path, REPO)} cites docs/{name} §{section}: no such section"
                )
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


def read(name):
    return open(os.path.join(REPO, name)).read()


def test_numbers_the_docs_quote_are_the_codes():
    """Figures the docs state about the code, recomputed from it: a change to the code that leaves a doc stale fails
    here."""
    from scripts import base_train, speedrun
    from nanochat import dataset
    from nag.archs import plan_for
    from nanochat.plan import MOMENTUM

    reproduce, design, readme = read("docs/reproduce.md"), read("docs/design.md"), read("README.md")
    # the two momentum schedules differ only when the warm-down starts before the momentum peak
    peak, warmdown = MOMENTUM["peak_step"], 0.65
    assert f"< ~{round(peak / (1 - warmdown)):,} steps" in reproduce
    # the published data budget: shards and expected epochs of the longer run (GPT, 9,474 steps of 2^20 tokens)
    tokens = 9474 * 2**20
    shards = dataset.shards_for(tokens)
    assert (
        f"{shards} shards" in reproduce
        and f"expected epochs ({dataset.expected_epochs(tokens, shards):.2f}" in reproduce
    )
    assert f"{1 - dataset.PACKING_KEPT:.0%} cropped" in reproduce
    # the published Muon weight decays
    for arch in ("gpt", "nag"):
        plan = plan_for(base_train.parse_args(["--preset", "published", "--arch", arch]), 32768, 8)
        assert f"{plan.weight_decay:.7f}" in design, (arch, plan.weight_decay)
    # README's NAG flag table: the defaults base_train really has
    defaults = base_train.build_parser().parse_args([])
    for flag, shown in re.findall(r"^\| `(--nag-[\w-]+)` \| ([^|]+) \|", readme, re.M):
        value = getattr(defaults, flag[2:].replace("-", "_"))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert float(shown.strip()) == value, (flag, shown, value)
