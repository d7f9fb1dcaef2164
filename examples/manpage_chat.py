"""Turn the operating system's section-1 manual pages into question-and-answer chat rows.

Run from the repository root (needs groff and the man pages under /usr/share/man):

    python examples/manpage_chat.py

It writes
    examples/data/manpages.jsonl                 training conversations (the harder corpus of
                                                 `make recipe`; see examples/data/MANPAGES.md)
    examples/data/manpages_heldout_prompts.jsonl prompts (with their reference answers) from
                                                 pages no training row comes from

Every answer is text of a manual page, cut at a sentence end; only the questions are made
from a few fixed phrasings. Unlike the quickstart's templated corpus, the answers are real
prose with a real vocabulary, so a drafter cannot learn them by heart as a template.

Deterministic: pages are taken in name order, a page is kept or held out by a hash of its
name, and the phrasing of each question is picked by a hash too, so the same man pages give the
same files. Only pages of Debian packages whose copyright file (machine-readable format) names a
free license for all their files (GPL, LGPL, BSD, MIT/Expat, ISC, Apache, Artistic, public
domain) are used; each row records its page, package and license.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parent
MAN_DIR = Path("/usr/share/man/man1")
DPKG_INFO = Path("/var/lib/dpkg/info")
DOC_DIR = Path("/usr/share/doc")

FREE_LICENSES = re.compile(r"GPL|BSD|MIT|Expat|ISC|Apache|Artistic|public[- ]domain|Zlib|X11", re.IGNORECASE)
MAX_PAGES = 1400
"""Pages read, in name order, among those of free-licensed packages (groff takes ~0.1 s each)."""
MAX_ROWS = 2400
"""Training rows written; at about 110 tokens a row this is the quickstart corpus's size."""
HELDOUT_SHARE = 0.06
"""Share of pages (by a hash of the name) whose questions only appear as held-out prompts."""
MAX_HELDOUT_PROMPTS = 80
MAX_OPTIONS_PER_PAGE = 5
MAX_ROWS_PER_PACKAGE = 120
"""So that no one package (git's 150 pages) makes most of the corpus."""
MAX_ANSWER_CHARS = 420
MIN_ANSWER_CHARS = 24

WHAT_QUESTIONS = ("What does the {cmd} command do?", "What is {cmd} for?", "Explain what {cmd} does.",
                  "What is {cmd}?", "Describe the {cmd} command.")
OPTION_QUESTIONS = ("What does {opt} do in {cmd}?", "In {cmd}, what is the {opt} option for?",
                    "Explain the {opt} option of {cmd}.", "What happens when I pass {opt} to {cmd}?")


def _unit_hash(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64


def _pick(choices: tuple[str, ...], key: str) -> str:
    return choices[int(_unit_hash(key) * len(choices))]


# ----------------------------------------------------------------------------- which pages


def page_packages(info_dir: Path = DPKG_INFO) -> dict[str, str]:
    """Installed file path -> the Debian package that ships it (from dpkg's file lists)."""
    owners = {}
    for listing in sorted(info_dir.glob("*.list")):
        package = listing.stem.split(":")[0]
        for line in listing.read_text(errors="replace").splitlines():
            if line.startswith(str(MAN_DIR)):
                owners[line] = package
    return owners


def package_license(package: str, doc_dir: Path = DOC_DIR) -> str | None:
    """The License of the "Files: *" stanza of a machine-readable copyright file, else None."""
    path = doc_dir / package / "copyright"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    stanza = re.search(r"^Files:\s*\*\s*$(.*?)^License:[ \t]*([^\n]+)$", text, re.MULTILINE | re.DOTALL)
    return stanza.group(2).strip() if stanza else None


@dataclass(frozen=True)
class Page:
    name: str
    """The page's file name without .1.gz, e.g. "ls"."""

    package: str
    license: str
    text: str
    """groff's plain-text rendering, one line per paragraph."""


def render(path: Path) -> str:
    """A page as plain ASCII, no overstriking, paragraphs unwrapped (a very long line length)."""
    source = gzip.decompress(path.read_bytes())
    result = subprocess.run(["groff", "-mandoc", "-Tascii", "-P-cbou", "-rLL=2000n", "-rHY=0"], input=source,
                            capture_output=True, timeout=30, check=False)
    return result.stdout.decode("ascii", errors="replace")


def free_pages(limit: int = MAX_PAGES) -> list[Page]:
    owners = page_packages()
    licenses: dict[str, str | None] = {}
    pages = []
    for path in sorted(MAN_DIR.glob("*.1.gz")):
        if path.is_symlink() or not path.is_file() or str(path) not in owners:
            continue
        package = owners[str(path)]
        if package not in licenses:
            licenses[package] = package_license(package)
        license_name = licenses[package]
        if not license_name or not FREE_LICENSES.search(license_name):
            continue
        text = render(path)
        if text.strip():
            pages.append(Page(path.name.removesuffix(".1.gz"), package, license_name, text))
        if len(pages) >= limit:
            break
    return pages


# ----------------------------------------------------------------------------- what a page says


def sections(text: str) -> dict[str, list[str]]:
    """Section heading (a line at column 0 in capitals) -> its lines, in order."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.upper() == line and re.match(r"^[A-Z][A-Z /-]*$", line.strip()):
            current = line.strip()
            out.setdefault(current, [])
        elif current is not None:
            out[current].append(line.rstrip())
    return out


def clean(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("\ufffd", "")).strip()


def first_sentences(text: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """The longest run of whole sentences within `limit` chars (the first sentence cut at a word
    when even it is longer)."""
    text = clean(text)
    if len(text) <= limit:
        return text
    cut = max((m.end() for m in re.finditer(r"[.!?](?=\s)", text[:limit + 1])), default=0)
    if cut >= MIN_ANSWER_CHARS:
        return text[:cut]
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def name_line(secs: dict[str, list[str]]) -> tuple[str, str] | None:
    """(command, one-line description) from the NAME section "cmd - what it does"."""
    text = clean(" ".join(secs.get("NAME", [])))
    match = re.match(r"^(\S+?)(?:,.*?)?\s+\\?-+\s+(.+)$", text)
    if not match:
        return None
    return match.group(1), match.group(2).rstrip(".")


def paragraphs(lines: list[str]) -> list[tuple[int, str]]:
    """(indent, text) of each non-empty line (groff with a huge line length: one per paragraph)."""
    return [(len(line) - len(line.lstrip()), line.strip()) for line in lines if line.strip()]


def options(lines: list[str]) -> list[tuple[str, str]]:
    """(option tag, its description) pairs: a line starting with "-" and the deeper-indented
    paragraph after it (or on the same line after a wide gap)."""
    found = []
    items = paragraphs(lines)
    for i, (indent, text) in enumerate(items):
        if not text.startswith("-") or len(text) < 2 or not text[1].isalnum() and text[1] != "-":
            continue
        tag, _, rest = re.split(r"(\s{2,})", text, maxsplit=1) if re.search(r"\s{2,}", text) else (text, "", "")
        tag, rest = tag.strip(), rest.strip()
        if not rest and i + 1 < len(items) and items[i + 1][0] > indent:
            rest = items[i + 1][1]
        if rest and len(tag) <= 40 and len(rest) >= MIN_ANSWER_CHARS:
            found.append((tag, rest))
    return found


def page_rows(page: Page) -> list[dict]:
    """The question-and-answer chats of one page: what the command is, then some of its options."""
    secs = sections(page.text)
    named = name_line(secs)
    if named is None:
        return []
    cmd, summary = named
    description = next((t for _, t in paragraphs(secs.get("DESCRIPTION", [])) if not t.startswith("-")), "")
    about = first_sentences(f"{cmd} - {summary}. {description}".strip())
    source = {"page": f"{page.name}(1)", "package": page.package, "license": page.license}
    rows = [{"messages": [{"role": "user", "content": _pick(WHAT_QUESTIONS, page.name).format(cmd=cmd)},
                          {"role": "assistant", "content": about}], "source": source}]
    option_lines = secs.get("OPTIONS", []) + secs.get("DESCRIPTION", [])
    seen = set()
    for tag, text in options(option_lines):
        if tag in seen or len(seen) >= MAX_OPTIONS_PER_PAGE:
            continue
        seen.add(tag)
        question = _pick(OPTION_QUESTIONS, f"{page.name} {tag}").format(cmd=cmd, opt=tag)
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": first_sentences(text)}], "source": source})
    return [r for r in rows if usable_answer(r["messages"][1]["content"])]


def usable_answer(text: str) -> bool:
    # an answer that ends in ":" announces an example the row does not hold
    return len(text) >= MIN_ANSWER_CHARS and text.isascii() and not text.endswith(":")


def split_rows(pages: list[Page]) -> tuple[list[dict], list[dict]]:
    """Training rows and held-out prompts; a page's rows all go to one side."""
    train, heldout, per_package = [], [], {}
    for page in pages:
        rows = page_rows(page)
        if _unit_hash(f"heldout {page.name}") < HELDOUT_SHARE:
            heldout.extend(rows)
            continue
        room = MAX_ROWS_PER_PACKAGE - per_package.get(page.package, 0)
        train.extend(rows[:max(room, 0)])
        per_package[page.package] = per_package.get(page.package, 0) + min(len(rows), max(room, 0))
    train = [{"id": f"man-{i:05d}", **row} for i, row in enumerate(train[:MAX_ROWS])]
    heldout = [{"id": f"man-heldout-{i:04d}", **row} for i, row in enumerate(heldout[:MAX_HELDOUT_PROMPTS])]
    return train, heldout


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=EXAMPLES_DIR / "data", help="folder of the two JSONL files")
    args = parser.parse_args()
    if not MAN_DIR.is_dir():
        sys.exit(f"error: {MAN_DIR} does not exist; this script needs the system's man pages (apt-get install "
                 "man-db manpages), or use the shipped examples/data/manpages.jsonl")
    pages = free_pages()
    train, heldout = split_rows(pages)
    write_jsonl(args.out / "manpages.jsonl", train)
    write_jsonl(args.out / "manpages_heldout_prompts.jsonl", heldout)
    packages = sorted({r["source"]["package"] for r in train + heldout})
    print(f"{len(pages)} pages of {len(packages)} packages -> {len(train)} training rows, "
          f"{len(heldout)} held-out prompts in {args.out}")


if __name__ == "__main__":
    main()
