"""The README is a newcomer's first page: short, with the two set-up commands, and every relative link in it leading
to a file in the checkout (the rest of the documentation is the mkdocs site under docs/, which `make test` builds
with --strict)."""
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"

MAX_README_LINES = 200
# [text](target), not ![image](...) alternatives nor reference-style links; the target ends at the first space or ')'
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_link_targets(markdown: str) -> list[str]:
    """Each link target that is a path in the checkout (no scheme, not a bare #anchor), without its #anchor."""
    targets = []
    for target in LINK.findall(markdown):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def test_readme_is_under_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) < MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_keeps_the_two_set_up_commands():
    text = README.read_text()
    assert re.search(r"^make run\b", text, re.MULTILINE)
    assert re.search(r"^make test\b", text, re.MULTILINE)


def test_every_relative_link_in_the_readme_resolves():
    targets = relative_link_targets(README.read_text())
    assert targets, "README.md links nowhere: it should point into docs/"
    missing = [t for t in targets if not (REPO_ROOT / t).exists()]
    assert missing == []


def test_relative_link_targets_skips_urls_and_anchors_and_drops_fragments():
    text = "[a](docs/x.md#part) [b](https://example.com/y.md) [c](#here) ![d](docs/p.png) [e](mailto:a@b.c)"
    assert relative_link_targets(text) == ["docs/x.md", "docs/p.png"]
