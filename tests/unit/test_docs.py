"""Reasons in code, numbers in docs: every ``docs/*.md#anchor`` link resolves (and every relative
link of a docs/ page), and dptrain's docstrings and comments hold no measurement.

A docstring gives the reason for the code in one sentence and links the section of
``docs/measurements.md`` that keeps the figures, the machine, the date and the command. What
counts as a measurement here, in a docstring or comment of ``dptrain/`` (``.py``: every string
that stands alone as a statement, the module, class, function and attribute docstrings, plus
``#`` comments; ``.c``, ``.cc``, ``.cu``, ``.h``, ``.cuh``: ``//`` and ``/* */`` comments):

- a ratio: a number followed by ``x`` or ``×`` and then no letter or digit (``1.07x``, ``3×``,
  ``2x slower``). Shapes and products (``3x3``, ``32x32x3``, ``2x4`` luma) are not ratios, and
  neither are hex literals (``0x7fc0``) or names (``cupy-cuda13x``), since a letter or digit
  sits on one side;
- a date, ``2026-11-27`` or ``20261127``;
- a path into ``benchmarks/results/`` (reports are dated and get superseded; docs/measurements.md
  links the current one);
- a throughput figure: a number followed by ``img/s``, ``images/s``, ``GB/s``, ``GiB/s`` or ``MB/s``;
- two timings compared: a number in ``ms`` or ``s`` followed by ``against``, ``vs`` or ``versus``.

A single duration that sizes a design choice (``~1 ms of work``, ``~1 s at startup``) is not flagged:
it is read by a reviewer, not by this test. :data:`ALLOWED` lists the few matches that are design
facts rather than measurements, each with its reason; an entry that no longer matches anything
fails the test, so the list cannot go stale.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dptrain"
C_SUFFIXES = (".c", ".cc", ".cu", ".h", ".cuh")

LINK = re.compile(r"docs/([\w./-]+?\.md)(?:#([\w-]+))?")
"""A link into docs/: the file, and the anchor when there is one."""

PATTERNS: dict[str, re.Pattern[str]] = {
    "ratio": re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?[x×](?!\w)"),
    "date": re.compile(r"(?<!\d)20\d\d(?:-[01]\d-[0-3]\d|[01]\d[0-3]\d)(?!\d)"),
    "results link": re.compile(r"benchmarks/results"),
    "throughput": re.compile(r"\d\s?(?:img/s|images/s|GB/s|GiB/s|MB/s)"),
    "timings compared": re.compile(r"\d\s?m?s\)?,?\s+(?:against|vs\.?|versus)\s", re.I),
}
"""What a docstring or comment may not hold (the module docstring gives the rule)."""

ALLOWED: tuple[tuple[str, str, str], ...] = (
    ("dptrain/data/transforms/render.py", r"(?:shrinks (?:by |>= )?|less than )2x",
     "JPEG draft mode's threshold: libjpeg's smallest DCT scale is 1/2, a property of the decoder"),
    ("dptrain/csrc/record_render.c", r"shrinks 2x",
     "the same draft-mode threshold, in the native renderer that mirrors render.py"),
)
"""(path, regex around the match, reason): matches of :data:`PATTERNS` that are design facts."""


def _github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation other than ``-`` and ``_`` dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a markdown file: its headings' (with GitHub's ``-1``, ``-2`` for repeats,
    outside code fences) and explicit ``<a id="...">`` ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(re.findall(r"""<a\s+(?:id|name)=["']([^"']+)["']""", line))
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = _github_anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*")
                  if p.suffix in (".py", *C_SUFFIXES) and "__pycache__" not in p.parts)


def _python_docs(src: str) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and comment of a Python source."""
    out = [(node.lineno, node.value.value) for node in ast.walk(ast.parse(src))
           if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
           and isinstance(node.value.value, str)]
    out += [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(src).readline)
            if tok.type == tokenize.COMMENT]
    return out


def _c_docs(src: str) -> list[tuple[int, str]]:
    """(first line, text) of every comment of a C, C++ or CUDA source."""
    return [(src.count("\n", 0, m.start()) + 1, m.group())
            for m in re.finditer(r"//[^\n]*|/\*.*?\*/", src, re.S)]


def doc_texts(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and comment in ``path``."""
    src = path.read_text(encoding="utf-8")
    return _python_docs(src) if path.suffix == ".py" else _c_docs(src)


def findings(path: Path, texts: list[tuple[int, str]], used: set[int]) -> list[str]:
    """``path:line: kind 'match' in: text`` for each measurement in ``texts`` that :data:`ALLOWED`
    does not excuse; the allow-list entries that excused one are added to ``used``."""
    rel = path.relative_to(REPO).as_posix()
    out = []
    for first, text in texts:
        flat = " ".join(text.split())  # a phrase may wrap across lines
        for kind, pattern in PATTERNS.items():
            for m in pattern.finditer(flat):
                excused = [i for i, (p, phrase, _) in enumerate(ALLOWED) if p == rel and any(
                    a.start() <= m.start() and m.end() <= a.end() for a in re.finditer(phrase, flat))]
                if excused:
                    used.update(excused)
                    continue
                context = flat[max(0, m.start() - 50):m.end() + 30]
                out.append(f"{rel}:{first}: {kind} {m.group()!r} in: ...{context}...")
    return out


def test_doc_links_resolve() -> None:
    """Every docs/<file>.md[#anchor] named in dptrain's sources or README.md exists."""
    broken, checked = [], 0
    readme = REPO / "README.md"
    for path in _sources() + ([readme] if readme.exists() else []):
        for m in LINK.finditer(path.read_text(encoding="utf-8")):
            checked += 1
            target = REPO / "docs" / m.group(1)
            where = f"{path.relative_to(REPO)}: docs/{m.group(1)}"
            if not target.is_file():
                broken.append(f"{where}: no such file")
            elif m.group(2) and m.group(2) not in anchors(target):
                broken.append(f"{where}#{m.group(2)}: no such anchor (has {sorted(anchors(target))})")
    assert checked > 0, "no docs/ link found: the scan is broken"
    assert not broken, "links into docs/ that do not resolve:\n" + "\n".join(broken)


def test_docs_pages_links_resolve() -> None:
    """Every relative link of a docs/ page (a results report, another page, an anchor) resolves, so a
    report renamed or merged in benchmarks/results/ fails here rather than leaving a dead link."""
    broken, checked = [], 0
    for page in sorted((REPO / "docs").glob("*.md")):
        for m in re.finditer(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            href = m.group(1)
            if re.match(r"[a-z]+:", href):  # http:, https:, mailto:
                continue
            checked += 1
            path, _, anchor = href.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.name}: {href}: no such file")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{page.name}: {href}: no such anchor")
    assert checked > 0, "no relative link found in docs/: the scan is broken"
    assert not broken, "links of docs/ pages that do not resolve:\n" + "\n".join(broken)


def test_no_measurements_in_docstrings_or_comments() -> None:
    """No docstring or comment in dptrain/ holds a ratio, a date, a results link, a throughput
    figure or two timings compared; the reason stays, the numbers go to docs/measurements.md."""
    used: set[int] = set()
    found = [f for path in _sources() for f in findings(path, doc_texts(path), used)]
    assert not found, ("measurements in dptrain's docstrings or comments: give the reason in one sentence and "
                       "link docs/measurements.md#<anchor>, which keeps the figures:\n" + "\n".join(found))
    stale = [f"{p}: {phrase!r}" for i, (p, phrase, _) in enumerate(ALLOWED) if i not in used]
    assert not stale, "allow-list entries that match nothing any more; remove them:\n" + "\n".join(stale)


def test_anchors_follow_github() -> None:
    """The anchor rule: GitHub's lowercase, punctuation-free, hyphenated form, repeats numbered."""
    assert _github_anchor("Gradient hand-over") == "gradient-hand-over"
    assert _github_anchor("`model.compile` on the CPU (2 solvers)") == "modelcompile-on-the-cpu-2-solvers"
    assert _github_anchor("data-native_render") == "data-native_render"


def test_the_rule_flags_measurements_and_spares_shapes() -> None:
    """The patterns catch what the rule names and pass shapes, hex and package names."""
    def kinds(text: str) -> list[str]:
        return [k for k, p in PATTERNS.items() if p.search(text)]

    assert kinds("stepped 1.07-1.09x faster") == ["ratio"]
    assert kinds("about 3× slower") == ["ratio"]
    assert kinds("the 2026-11-27 run") == ["date"]
    assert kinds("see design_20261127.md") == ["date"]
    assert kinds("(benchmarks/results/x.md)") == ["results link"]
    assert kinds("near 1,900 img/s") == ["throughput"]
    assert kinds("13.5 ms against 1-2.5 ms") == ["timings compared"]
    for fact in ("a 3x3 conv", "32x32x3 uint8", "NaN 0x7fc0", "cupy-cuda13x", "2x4 luma", "[B, C, H, W]",
                 "~1 ms of work", "the 200 us poll"):
        assert kinds(fact) == [], fact
