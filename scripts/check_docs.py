#!/usr/bin/env python3
"""The docs say what sluice does now, in pages a reader can finish.

Checks, for `make lint` (exit 1 and one line per problem):
- size budgets: each page, README plus docs/*.md together (120 KB), and
  design.md's adaptive-limits section (4 KB);
- markdown table cells of at most 600 characters;
- no development history in README, docs, src, tests or bench: numbered
  sessions or periods, commit ids, "reverted", "the build before", "an
  outside review", "this round";
- every local link resolves: the file, and a `#anchor` to a heading of it
  (GitHub's slugs).
Whole plugin configurations in ```json blocks are validated against the
schema by tests/tooling/test_schema.py.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TOTAL_BUDGET = 120_000
BUDGETS = {
    "README.md": 12_000,
    "docs/configuration.md": 35_000,
    "docs/design.md": 30_000,
    "docs/deploy.md": 9_000,
    "docs/global.md": 10_500,
    "docs/operations.md": 11_500,
    "docs/performance.md": 15_000,
}
# A section of a page, by its heading, and its budget.
SECTION_BUDGETS = {("docs/design.md", "Adaptive limits"): 4_000}
CELL_MAX = 600

HISTORY = re.compile(
    r"\bsessions? \d+|\bsession\b|\b(?:development )?periods? \d+\b|\breverted\b"
    r"|the build before|outside review|this round|\btried\b.*\breverted\b",
    re.IGNORECASE,
)
# A commit id: 7 to 40 hex digits with a letter and a digit among them
# (not a build's sha256, which the results table names its builds by).
COMMIT = re.compile(r"(?<!sha256 )\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
CODE_HISTORY = re.compile(
    r"\bsessions? \d+|\breverted\b|the build before|outside review", re.IGNORECASE
)


def pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(text):
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def anchors(text):
    seen, out = {}, set()
    for h in headings(text):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def prose(text):
    """The text outside fenced code blocks, with line numbers."""
    fence = False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield i, line


def section(text, title):
    lines, inside, level = [], False, 0
    for line in text.splitlines(keepends=True):
        m = re.match(r"(#{1,6}) (.*)", line)
        if m and inside and len(m.group(1)) <= level:
            break
        if m and m.group(2).strip() == title:
            inside, level = True, len(m.group(1))
        if inside:
            lines.append(line)
    return "".join(lines) if inside else None


def check():
    problems = []
    total = 0
    for page in pages():
        rel = page.relative_to(ROOT).as_posix()
        text = page.read_text()
        size = len(text.encode())
        total += size
        budget = BUDGETS.get(rel)
        if budget is None:
            problems.append(f"{rel}: no size budget set in scripts/check_docs.py")
        elif size > budget:
            problems.append(f"{rel}: {size} bytes, over its budget of {budget}")
        for i, line in prose(text):
            if m := HISTORY.search(line):
                problems.append(f"{rel}:{i}: development history ({m.group(0)!r})")
            if m := COMMIT.search(line):
                problems.append(f"{rel}:{i}: a commit id ({m.group(0)!r})")
            if line.lstrip().startswith("|"):
                cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
                for c in cells:
                    if len(c.strip()) > CELL_MAX:
                        problems.append(
                            f"{rel}:{i}: a table cell of {len(c.strip())} characters"
                            f" (at most {CELL_MAX})"
                        )
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    problems.append(f"{rel}:{i}: link to {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                    problems.append(f"{rel}:{i}: link to {target}: no such heading")
    if total > TOTAL_BUDGET:
        problems.append(f"README + docs: {total} bytes, over {TOTAL_BUDGET}")
    for (rel, title), budget in SECTION_BUDGETS.items():
        body = section((ROOT / rel).read_text(), title)
        if body is None:
            problems.append(f"{rel}: no section {title!r}")
        elif len(body.encode()) > budget:
            problems.append(f"{rel}: section {title!r} is {len(body.encode())} bytes (at most {budget})")
    for folder in ("src", "tests", "bench", "scripts"):
        for f in sorted((ROOT / folder).rglob("*")):
            if f.suffix not in (".rs", ".py") or "results" in f.parts or f.name == "check_docs.py":
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if m := CODE_HISTORY.search(line):
                    rel = f.relative_to(ROOT).as_posix()
                    problems.append(f"{rel}:{i}: development history ({m.group(0)!r})")
    return problems


def main():
    problems = check()
    for p in problems:
        print(p)
    if problems:
        sys.exit(1)
    print(f"docs: {len(pages())} pages within their budgets, no history, every link resolves")


if __name__ == "__main__":
    main()
