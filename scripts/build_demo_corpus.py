#!/usr/bin/env python3
"""Build the bundled multilingual demo corpus (``data/demo/``) from Debian documentation packages.

Why this exists: the demo and the mixture-quality benchmark need real, human-written, parallel
multilingual text that ships with the repository (no internet, no Hugging Face hub at run time).
Debian's documentation packages are exactly that: LibreOffice help, man pages, the Debian
installation guide and the GNOME user help, translated by people into many languages. This
script turns them into a small corpus mirroring the GRAPE paper's wiki40b set-up: six
high-resource *source* languages (the domains GRAPE reweights) and seven low-resource *target*
languages (the tasks GRAPE optimises for; Romanian, the paper's eighth, has too little text in
these packages and is left out).

Pipeline (all deterministic; same packages => byte-identical output):

1. ``apt-get download`` each package into ``--workdir`` (cached; a file already there with the
   size apt expects is reused) and unpack it with ``dpkg-deb -x`` (never ``apt-get install``).
2. Per language, turn every page into paragraphs of plain text: HTML / Mallard XML via a
   tag-aware parser (code blocks, navigation and metadata skipped, entities decoded), man pages
   via a small roff reader (requests, escapes, tables and no-fill blocks dropped).
3. Keep a paragraph only if it is at least ``MIN_PARAGRAPH_CHARS`` long, does not look like code
   or a command line, and ``langid`` (restricted to the 13 corpus languages) labels it as the
   expected language — translations fall back to English in places, which must not leak in.
4. A document is one page; its id (``<source>:<page path>``) carries no language, so the *same*
   page gets the *same* split in every language (see ``split_of``). Documents are taken in a
   seeded hash order until each (language, split) size budget is met; paragraphs already taken
   for the language are dropped (exact duplicates), test first so that evaluation text never
   reappears in training text.
5. Write ``<out>/<split>/<lang>.jsonl.zst`` (zstd level 19, one JSON object per document),
   ``<out>/corpus.json`` (languages, roles, sizes, package versions, checksums),
   ``<out>/README.md`` (the corpus card, with the contents table) and ``<out>/LICENSES.md``
   (every package's Debian copyright file, verbatim).

Usage::

    python scripts/build_demo_corpus.py --out data/demo --workdir ~/.cache/grape_stream/debian-docs
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import unicodedata
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable, Iterable

SCRIPT_VERSION = "1.0.0"

SOURCES = ("en", "fr", "de", "es", "ru", "it")
TARGETS = ("tr", "da", "ca", "pl", "nl", "uk", "pt")
LANGUAGES = SOURCES + TARGETS
SPLITS = ("train", "probe", "test")

#: Percentage of page ids (by seeded hash, the same in every language) per split.
SPLIT_PERCENT = {"test": 15, "probe": 15, "train": 70}

MIN_PARAGRAPH_CHARS = 40
#: Pages longer than this are cut, at paragraph boundaries, into parts of at most this size
#: (one document each, all in the page's split), so that a single huge man page (bash.1 is
#: 300k characters) cannot make up most of a small test set.
MAX_DOC_CHARS = 20_000
ZSTD_LEVEL = 19

#: Default size budget, in characters of document text, per (role, split). Sources are the
#: training domains; targets need probe (GRAPE's task losses) and test (reporting). Targets also
#: get a modest train split for experiments that train on them directly (unused by default).
DEFAULT_BUDGET = {
    ("source", "train"): 3_000_000,
    ("source", "probe"): 0,
    ("source", "test"): 100_000,
    ("target", "train"): 300_000,
    ("target", "probe"): 150_000,
    ("target", "test"): 150_000,
}

LIBREOFFICE_DIR = {lang: lang for lang in LANGUAGES if lang != "uk"} | {"en": "en-US"}
MANPAGES_PACKAGE = {"en": "manpages"} | {
    lang: f"manpages-{lang}" for lang in ("de", "fr", "es", "it", "ru", "pl", "nl", "uk", "da", "tr")
} | {"pt": "manpages-pt-br"}
MANPAGES_DIR = {"en": ""} | {lang: lang for lang in MANPAGES_PACKAGE if lang not in ("en", "pt")} | {
    "pt": "pt_BR"
}
INSTALL_GUIDE_LANGS = ("en", "fr", "de", "es", "ru", "it", "da", "ca", "nl", "pt")
GNOME_DIR = {lang: lang for lang in LANGUAGES} | {"en": "C"}  # pt = European Portuguese, not pt_BR


def packages() -> list[str]:
    """All Debian packages the corpus is built from, sorted."""
    pkgs = {f"libreoffice-help-{'en-us' if lang == 'en' else lang}" for lang in LIBREOFFICE_DIR}
    pkgs |= set(MANPAGES_PACKAGE.values())
    pkgs |= {"installation-guide-amd64", "gnome-user-docs"}
    return sorted(pkgs)


# --------------------------------------------------------------------------------------------
# Download and unpack
# --------------------------------------------------------------------------------------------


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)
    except FileNotFoundError as e:
        raise SystemExit(
            f"`{cmd[0]}` not found: this script needs a Debian/Ubuntu system with apt and dpkg "
            "(the committed data/demo/ corpus needs neither)."
        ) from e
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{e.stderr.strip()}") from e


def fetch_packages(pkgs: list[str], debdir: Path, offline: bool) -> dict[str, Path]:
    """Download each package's .deb into ``debdir`` unless a file of the expected size is there.

    ``apt-get download --print-uris`` names the exact file and size apt would fetch, which makes
    the cache safe across repository updates (a new version is a new file name).
    """
    from tqdm import tqdm

    debdir.mkdir(parents=True, exist_ok=True)
    debs: dict[str, Path] = {}
    if offline:
        for pkg in pkgs:
            found = sorted(debdir.glob(f"{pkg}_*.deb"))
            if not found:
                raise SystemExit(f"--offline: no {pkg}_*.deb in {debdir}")
            debs[pkg] = found[-1]
        return debs
    out = _run(["apt-get", "download", "--print-uris", *pkgs]).stdout
    wanted: dict[str, tuple[str, int]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].startswith("'"):
            fname, size = parts[1], int(parts[2])
            wanted[fname.split("_", 1)[0]] = (fname, size)
    missing = [p for p in pkgs if p not in wanted]
    if missing:
        raise SystemExit(f"apt knows no candidate for {missing}; run `apt-get update` first")
    todo = [p for p in pkgs if not ((debdir / wanted[p][0]).is_file()
                                    and (debdir / wanted[p][0]).stat().st_size == wanted[p][1])]
    for pkg in tqdm(todo, desc="apt-get download", unit="pkg", disable=not todo):
        _run(["apt-get", "download", pkg], cwd=debdir)
    for pkg in pkgs:
        path = debdir / wanted[pkg][0]
        if not path.is_file():
            # apt escapes ':' in epochs as %3a in file names; --print-uris does the same.
            raise SystemExit(f"apt-get download {pkg} did not produce {path}")
        debs[pkg] = path
    return debs


def unpack(debs: dict[str, Path], rootdir: Path) -> dict[str, tuple[Path, str]]:
    """``dpkg-deb -x`` every package into its own folder; returns {pkg: (root, version)}."""
    from tqdm import tqdm

    roots: dict[str, tuple[Path, str]] = {}
    for pkg, deb in tqdm(sorted(debs.items()), desc="dpkg-deb -x", unit="pkg"):
        version = _run(["dpkg-deb", "-f", str(deb), "Version"]).stdout.strip()
        root = rootdir / deb.stem
        done = root / ".unpacked"
        if not done.is_file():
            if root.exists():
                shutil.rmtree(root)
            root.mkdir(parents=True)
            _run(["dpkg-deb", "-x", str(deb), str(root)])
            done.write_text(version + "\n")
        roots[pkg] = (root, version)
    return roots


# --------------------------------------------------------------------------------------------
# Markup -> paragraphs
# --------------------------------------------------------------------------------------------

#: Elements whose whole content is dropped: code, navigation, metadata.
SKIP_TAGS = {
    "script", "style", "head", "header", "footer", "nav", "aside", "noscript", "pre", "screen",
    "info", "synopsis", "programlisting", "object", "svg", "math", "button", "label", "select",
    "comment",
}
#: ``class`` values (HTML) whose element content is dropped.
SKIP_CLASSES = {"navheader", "navfooter", "toc", "debug", "bascode", "programlisting", "screen",
                "literallayout", "synopsis", "cmdsynopsis", "funcsynopsis", "index", "relatedtopics"}
#: Inline elements: skipping one does not end the paragraph around it.
INLINE_TAGS = {"span", "a", "em", "strong", "b", "i", "u", "code", "tt", "kbd", "var", "sup",
               "sub", "small", "big", "font", "img", "media", "gui", "guiseq", "key", "keyseq",
               "cmd", "sys", "app", "file", "input", "output", "link", "abbr", "acronym"}
#: Elements that end a paragraph (HTML and Mallard).
BLOCK_TAGS = {
    "p", "div", "br", "h1", "h2", "h3", "h4", "h5", "h6", "li", "ul", "ol", "dl", "dt", "dd",
    "table", "tr", "td", "th", "thead", "tbody", "caption", "blockquote", "hr", "section",
    "title", "desc", "item", "list", "steps", "terms", "tree", "note", "figure", "listing",
    "links", "page", "body", "html", "subtitle", "example",
}


class _ParagraphParser(HTMLParser):
    """Collects text, cutting paragraphs at block elements and skipping code/navigation."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._buf: list[str] = []
        self._skip_tag: str | None = None
        self._skip_depth = 0

    def _flush(self) -> None:
        if self._buf:
            self.paragraphs.append("".join(self._buf))
            self._buf = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip_tag is not None:
            if tag == self._skip_tag:
                self._skip_depth += 1
            return
        attr = dict(attrs)
        classes = set((attr.get("class") or "").split())
        # LibreOffice help repeats a phrase per system/module in hidden <span>s (macOS, Writer,
        # Calc, ...); the one shown by default has an id starting with "default".
        hidden = "hidden" in attr and not (attr.get("id") or "").startswith("default")
        if tag in SKIP_TAGS or classes & SKIP_CLASSES or hidden:
            if tag not in INLINE_TAGS:
                self._flush()
            self._skip_tag, self._skip_depth = tag, 1
            return
        if tag in BLOCK_TAGS:
            self._flush()

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip_tag is None and tag in BLOCK_TAGS:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if self._skip_tag is not None:
            if tag == self._skip_tag:
                self._skip_depth -= 1
                if self._skip_depth == 0:
                    self._skip_tag = None
            return
        if tag in BLOCK_TAGS:
            self._flush()

    def handle_data(self, data: str) -> None:
        if self._skip_tag is None:
            self._buf.append(data)

    def close(self) -> None:
        super().close()
        self._flush()


def markup_paragraphs(text: str) -> list[str]:
    """Paragraphs of an HTML page or a Mallard (XML) page, raw (not yet normalised)."""
    parser = _ParagraphParser()
    parser.feed(text)
    parser.close()
    return parser.paragraphs


# --- roff (man pages) ------------------------------------------------------------------------

_ROFF_CHARS = {
    "em": "—", "en": "–", "hy": "-", "aq": "'", "dq": '"', "bu": "•", "lq": "“", "rq": "”",
    "oq": "‘", "cq": "’", "co": "©", "rg": "®", "tm": "™", "Fo": "«", "Fc": "»", "fo": "‹",
    "fc": "›", "Bq": "„", "bq": "‚", "ga": "`", "ti": "~", "ha": "^", "rs": "\\", "sl": "/",
    "mi": "-", "pl": "+", "eq": "=", "mu": "×", "di": "÷", "de": "°", "->": "→", "<-": "←",
    "<=": "≤", ">=": "≥", "!=": "≠", "+-": "±", "ss": "ß", "ae": "æ", "AE": "Æ", "o/": "ø",
    "O/": "Ø", "lh": "☜", "rh": "☞", "ba": "|", "br": "│", "ul": "_", "ct": "¢", "Po": "£",
    "Eu": "€", "Ye": "¥", "sc": "§", "ps": "¶", "dg": "†", "dd": "‡", "at": "@", "sh": "#",
    "Do": "$", "lB": "[", "rB": "]", "lC": "{", "rC": "}", "la": "⟨", "ra": "⟩", "tno": "~",
}
_ROFF_STRINGS = {"lq": "“", "rq": "”", "R": "®", "Tm": "™", "Lq": "“", "Rq": "”"}
_ESCAPE = re.compile(
    r"""\\(?:
        (?P<font>f(?:\[[^\]]*\]|\(..|.))
      | (?P<char2>\(..)
      | (?P<charb>\[[^\]]*\])
      | (?P<str>\*(?:\[[^\]]*\]|\(..|.))
      | (?P<size>s(?:[-+]?\d{1,2}|\[[^\]]*\]|\([-+]?\d\d|[-+]?\(\d\d))
      | (?P<arg>[hvwlLDXbBoSRZxNYVkm]('[^']*'|\[[^\]]*\]|\(..|.))
      | (?P<reg>[ngF\$](?:\[[^\]]*\]|\(..|.))
      | (?P<other>.)
    )""",
    re.VERBOSE,
)
_SIMPLE_ESCAPES = {
    "-": "-", "e": "\\", "\\": "\\", "&": "", ",": "", "/": "", "^": "", "|": "", ":": "",
    " ": " ", "~": " ", "0": " ", "c": "", "%": "", ".": ".", "'": "'", "`": "`", "t": " ",
    "p": "", "d": "", "u": "", "r": "", "a": "", "z": "", "!": "", "{": "", "}": "", "?": "",
    "E": "", "_": "_", "=": "=", "+": "+",
}


def _roff_char(name: str) -> str:
    if name.startswith("u") and re.fullmatch(r"u[0-9A-Fa-f]{4,6}(_[0-9A-Fa-f]{4,6})*", name):
        return "".join(chr(int(p.lstrip("u"), 16)) for p in name.split("_"))
    return _ROFF_CHARS.get(name, "")


def roff_unescape(line: str) -> str:
    """Plain text of one roff text line: fonts, sizes, motions dropped; special chars mapped."""

    def sub(m: re.Match) -> str:
        if m.group("font") or m.group("size") or m.group("reg"):
            return ""
        if m.group("char2"):
            return _roff_char(m.group("char2")[1:])
        if m.group("charb"):
            return _roff_char(m.group("charb")[1:-1])
        if m.group("str"):
            name = m.group("str")[1:].strip("[]").lstrip("(")
            return _ROFF_STRINGS.get(name, "")
        if m.group("arg"):
            if m.group(0)[1] == "N":  # \N'123' = character by number
                num = re.sub(r"\D", "", m.group("arg")[1:])
                return chr(int(num)) if num else ""
            return ""
        return _SIMPLE_ESCAPES.get(m.group("other"), "")

    return _ESCAPE.sub(sub, line)


def _macro_args(rest: str) -> list[str]:
    """Split roff macro arguments: whitespace-separated, double quotes group."""
    args, cur, quoted, i = [], [], False, 0
    while i < len(rest):
        ch = rest[i]
        if ch == "\\" and i + 1 < len(rest):
            cur.append(rest[i : i + 2])
            i += 2
            continue
        if ch == '"':
            if quoted and i + 1 < len(rest) and rest[i + 1] == '"':
                cur.append('"')
                i += 2
                continue
            quoted = not quoted
        elif ch in " \t" and not quoted:
            if cur:
                args.append("".join(cur))
                cur = []
        else:
            cur.append(ch)
        i += 1
    if cur:
        args.append("".join(cur))
    return args


_BREAK_MACROS = {"PP", "P", "LP", "SH", "SS", "TP", "TQ", "IP", "HP", "sp", "br", "RS", "RE",
                 "in", "ti", "SY", "YS", "bp", "ne", "PD", "Sh", "Ss", "Pp", "It", "Bl", "El"}
_FONT_MACROS = {"B", "I", "SM", "SB"}
_ALT_MACROS = {"BR", "RB", "IR", "RI", "BI", "IB"}
_SKIP_BLOCKS = {"nf": "fi", "EX": "EE", "TS": "TE", "EQ": "EN", "PS": "PE", "de": "..",
                "de1": "..", "am": "..", "ig": "..", "Bd": "Ed"}


def roff_paragraphs(text: str) -> list[str]:
    """Paragraphs of a man(7) page; ``[]`` for mdoc(7) pages and ``.so`` redirects.

    A deliberately small reader: text lines and the text arguments of font macros are kept,
    every other request is dropped, and no-fill / example / table / macro-definition blocks are
    skipped whole (they are code, synopses or layout). Section headings and ``.TP`` tags become
    their own (short) paragraphs, which the length filter later removes.
    """
    lines = text.splitlines()
    heads = [ln for ln in lines[:200] if ln.startswith(".")]
    if any(ln.startswith((".Dd", ".Dt")) for ln in heads) or (
        heads and heads[0].startswith(".so ") and len([ln for ln in lines if ln.strip()]) < 5
    ):
        return []
    paragraphs: list[str] = []
    buf: list[str] = []
    end_block: str | None = None
    tag_next = False

    def flush() -> None:
        if buf:
            paragraphs.append(" ".join(buf))
            buf.clear()

    for raw in lines:
        if end_block is not None:
            if raw.rstrip() in ("." + end_block, "'" + end_block) or (
                end_block == ".." and raw.strip() == ".."
            ) or raw.startswith(("." + end_block + " ", "'" + end_block + " ")):
                end_block = None
            continue
        line = raw.split('\\"', 1)[0] if '\\"' in raw else raw  # roff comment
        if line.startswith(("." , "'")):
            body = line[1:].lstrip()
            name, _, rest = body.partition(" ")
            name = name.strip()
            if not name:
                continue
            if name in _SKIP_BLOCKS:
                flush()
                end_block = _SKIP_BLOCKS[name]
                continue
            if name in _BREAK_MACROS:
                flush()
                if name in ("SH", "SS", "Sh", "Ss") and rest.strip():
                    paragraphs.append(roff_unescape(" ".join(_macro_args(rest))))
                tag_next = name in ("TP", "TQ")
                continue
            if name in _FONT_MACROS:
                if rest.strip():
                    buf.append(roff_unescape(" ".join(_macro_args(rest))))
            elif name in _ALT_MACROS:
                buf.append(roff_unescape("".join(_macro_args(rest))))
            elif name in ("UR", "MT", "UE", "ME"):
                pass  # the link text lies between UR/UE; the URL itself is dropped
            else:
                continue  # TH, ad, nh, if/ie/el, ds, ... : layout or logic, not text
        else:
            if not line.strip():
                flush()
                continue
            buf.append(roff_unescape(line))
        if tag_next:
            flush()  # the .TP tag line (an option, a name) is its own paragraph
            tag_next = False
    flush()
    return paragraphs


# --------------------------------------------------------------------------------------------
# Paragraph filtering
# --------------------------------------------------------------------------------------------

_WS = re.compile(r"\s+")
_INVISIBLE = dict.fromkeys(map(ord, "\u00ad\u200b\u200c\u200d\u2060\ufeff"), None)
_CODE_CHARS = set("{}[]<>=_/\\|;$#@*^~`")
_COMMAND = re.compile(r"^(\$|#|%|>>>|sudo |apt(-get)? |dpkg |C:\\|/[a-z]+/)")


def normalise(paragraph: str) -> str:
    """NFC, invisible characters removed, whitespace collapsed to single spaces."""
    text = unicodedata.normalize("NFC", paragraph).translate(_INVISIBLE)
    return _WS.sub(" ", text).strip()


def looks_like_code(paragraph: str) -> bool:
    """True for command lines, code, option lists and other non-prose fragments."""
    if _COMMAND.match(paragraph):
        return True
    chars = [c for c in paragraph if not c.isspace()]
    if not chars:
        return True
    letters = sum(c.isalpha() for c in chars)
    if letters / len(chars) < 0.65:
        return True
    words = paragraph.split()
    codey = sum(1 for w in words if any(c in _CODE_CHARS for c in w) or w.startswith("-"))
    if codey / len(words) > 0.25:
        return True
    return len(words) < 4


class LanguageFilter:
    """langid restricted to the corpus languages: keep a paragraph only if it is ``lang``."""

    def __init__(self, languages: Iterable[str] = LANGUAGES, min_prob: float = 0.5) -> None:
        from langid.langid import LanguageIdentifier, model

        self.identifier = LanguageIdentifier.from_modelstring(model, norm_probs=True)
        self.identifier.set_languages(sorted(languages))
        self.min_prob = min_prob

    def __call__(self, paragraph: str, lang: str) -> bool:
        label, prob = self.identifier.classify(paragraph)
        return label == lang and prob >= self.min_prob


# --------------------------------------------------------------------------------------------
# Pages per language
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    """One source page in one language; ``doc_id`` is shared by its translations."""

    doc_id: str
    source: str
    path: Path
    reader: Callable[[Path], list[str]]


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def read_markup(path: Path) -> list[str]:
    return markup_paragraphs(_read_text(path))


def read_roff(path: Path) -> list[str]:
    return roff_paragraphs(_read_text(path))


def pages_for(lang: str, roots: dict[str, tuple[Path, str]]) -> list[Page]:
    """Every page available in ``lang`` across the four packages, sorted by doc_id."""
    pages: dict[str, Page] = {}

    def add(page: Page) -> None:
        pages.setdefault(page.doc_id, page)

    if lang in LIBREOFFICE_DIR:
        pkg = f"libreoffice-help-{'en-us' if lang == 'en' else lang}"
        base = roots[pkg][0] / "usr/share/libreoffice/help" / LIBREOFFICE_DIR[lang]
        for p in sorted((base / "text").rglob("*.html")):
            rel = p.relative_to(base).with_suffix("").as_posix()
            add(Page(f"libreoffice-help:{rel}", "libreoffice-help", p, read_markup))
    if lang in MANPAGES_PACKAGE:
        base = roots[MANPAGES_PACKAGE[lang]][0] / "usr/share/man" / MANPAGES_DIR[lang]
        for p in sorted(base.glob("man*/*.gz")):
            if p.is_symlink():
                continue
            rel = f"{p.parent.name}/{p.name[:-3]}"
            add(Page(f"manpages:{rel}", "manpages", p, read_roff))
    if lang in INSTALL_GUIDE_LANGS:
        base = roots["installation-guide-amd64"][0] / "usr/share/doc/installation-guide-amd64" / lang
        for p in sorted(base.glob("*.html")):
            add(Page(f"installation-guide:{p.stem}", "installation-guide", p, read_markup))
    base = roots["gnome-user-docs"][0] / "usr/share/help" / GNOME_DIR[lang] / "gnome-help"
    for p in sorted(base.glob("*.page")):
        add(Page(f"gnome-user-docs:{p.stem}", "gnome-user-docs", p, read_markup))
    return [pages[k] for k in sorted(pages)]


# --------------------------------------------------------------------------------------------
# Splits and selection
# --------------------------------------------------------------------------------------------


def page_hash(doc_id: str, seed: int) -> int:
    """Seeded, platform-independent 64-bit hash of a page id (no language in it)."""
    digest = hashlib.sha256(f"grape-demo/{seed}/{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def split_of(doc_id: str, seed: int) -> str:
    """Split of a page, identical in every language.

    Why per page and not per (page, language): the pages are translations of one another. If
    page X were in the Catalan test set and its French translation in the French training set,
    the test score would partly measure cross-lingual recall of X's names, numbers and
    identifiers. Splitting by page id keeps every probe and test page out of every language's
    training data, while sources still help targets through shared vocabulary, the shared
    technical domain and language relatedness — the transfer GRAPE is meant to exploit.
    """
    bucket = page_hash(doc_id, seed) % 100
    if bucket < SPLIT_PERCENT["test"]:
        return "test"
    if bucket < SPLIT_PERCENT["test"] + SPLIT_PERCENT["probe"]:
        return "probe"
    return "train"


@dataclass
class Selected:
    docs: dict[str, list[dict]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    chars: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})
    available_chars: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})


def filtered_paragraphs(page: Page, lang: str, langfilter: LanguageFilter) -> list[str]:
    """The page's paragraphs that pass the length, code and language checks, in page order."""
    kept: list[str] = []
    for para in page.reader(page.path):
        para = normalise(para)
        if len(para) < MIN_PARAGRAPH_CHARS or looks_like_code(para):
            continue
        if langfilter(para, lang):
            kept.append(para)
    return kept


def split_parts(paragraphs: list[str], max_chars: int = MAX_DOC_CHARS) -> list[list[str]]:
    """Greedy cut of a page into consecutive parts of at most ``max_chars`` (joined by newlines).

    A single paragraph longer than ``max_chars`` is kept whole as its own part.
    """
    parts: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for para in paragraphs:
        extra = len(para) + (1 if cur else 0)
        if cur and size + extra > max_chars:
            parts.append(cur)
            cur, size, extra = [], 0, len(para)
        cur.append(para)
        size += extra
    if cur:
        parts.append(cur)
    return parts


def select_language(lang: str, pages: list[Page], budget: dict[str, int], seed: int,
                    langfilter: LanguageFilter, progress: bool = True) -> Selected:
    """Filter every page's paragraphs, then fill each split's budget in seeded hash order.

    Documents (pages, or parts of long pages) are visited test first, then probe, then train,
    so a paragraph repeated across pages (boilerplate) is kept in evaluation text and dropped
    from training text, never both. A split takes documents until its budget is reached, so it
    overshoots by less than one document (at most ``MAX_DOC_CHARS``).
    """
    from tqdm import tqdm

    docs: list[tuple[int, int, str, str, str, list[str]]] = []
    order = {"test": 0, "probe": 1, "train": 2}
    sel = Selected()
    for page in tqdm(pages, desc=f"{lang} pages", unit="page", disable=not progress, leave=False):
        kept = filtered_paragraphs(page, lang, langfilter)
        if not kept:
            continue
        split = split_of(page.doc_id, seed)
        parts = split_parts(kept)
        for k, part in enumerate(parts, 1):
            doc_id = page.doc_id if len(parts) == 1 else f"{page.doc_id}#{k}"
            docs.append((order[split], page_hash(doc_id, seed), doc_id, split, page.source, part))
            sel.available_chars[split] += sum(map(len, part)) + len(part) - 1
    docs.sort(key=lambda d: d[:3])
    seen: set[bytes] = set()
    for _, _, doc_id, split, source, part in docs:
        if sel.chars[split] >= budget[split]:
            continue
        fresh = []
        for para in part:
            key = hashlib.blake2b(para.encode(), digest_size=16).digest()
            if key not in seen:
                seen.add(key)
                fresh.append(para)
        if not fresh:
            continue
        text = "\n".join(fresh)
        sel.docs[split].append({"text": text, "lang": lang, "split": split,
                                "source": source, "doc_id": doc_id})
        sel.chars[split] += len(text)
    return sel


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def write_jsonl_zst(path: Path, docs: list[dict]) -> tuple[int, int]:
    """One JSON object per line, zstd level 19 in one frame; returns (raw bytes, file bytes)."""
    import zstandard

    raw = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    data = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True).compress(raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(raw), len(data)


def write_licenses(path: Path, roots: dict[str, tuple[Path, str]], used: list[str]) -> None:
    """Every shipped package's Debian copyright file, verbatim; identical files printed once."""
    by_text: dict[str, list[str]] = {}
    for pkg in used:
        f = roots[pkg][0] / "usr/share/doc" / pkg / "copyright"
        if not f.is_file():
            raise SystemExit(f"{pkg}: no usr/share/doc/{pkg}/copyright in the package")
        by_text.setdefault(f.read_text(encoding="utf-8", errors="replace"), []).append(pkg)
    out = io.StringIO()
    out.write("# Licenses of the demo corpus text\n\n"
              "The text in `data/demo/` is extracted from the Debian packages below (Debian 12\n"
              "\"bookworm\"). Each package's license terms are its Debian copyright file\n"
              "(`/usr/share/doc/<package>/copyright`), reproduced verbatim below; packages\n"
              "with identical copyright files share one section. In short (the sections below\n"
              "are authoritative): LibreOffice help is MPL-2.0, with some Apache-2.0 material;\n"
              "the man page translations are GPL (manpages-l10n: GPL-3+; manpages-tr: GNU GPL)\n"
              "of pages under their own licenses (GPL, BSD, Linux-man-pages-copyleft, ...); the\n"
              "English man pages are Linux-man-pages-copyleft, GPL and BSD licensed; the Debian\n"
              "installation guide is GPL-2; GNOME user help is CC-BY-SA-3.0. The corpus is a\n"
              "modification of these texts (markup removed, paragraphs filtered and selected),\n"
              "made by `scripts/build_demo_corpus.py`.\n\n")
    out.write("| package | version | copyright section |\n|---|---|---|\n")
    section_of = {}
    for i, (_, pkgs) in enumerate(sorted(by_text.items(), key=lambda kv: kv[1][0]), 1):
        for pkg in pkgs:
            section_of[pkg] = i
    for pkg in used:
        out.write(f"| `{pkg}` | {roots[pkg][1]} | [{section_of[pkg]}](#copyright-{section_of[pkg]}) |\n")
    for i, (text, pkgs) in enumerate(sorted(by_text.items(), key=lambda kv: kv[1][0]), 1):
        out.write(f"\n## Copyright {i}\n\nPackages: {', '.join(f'`{p}`' for p in pkgs)}\n\n")
        fence = "````" if "```" in text else "```"
        out.write(f"{fence}text\n{text.rstrip()}\n{fence}\n")
    path.write_text(out.getvalue(), encoding="utf-8")


README_TEMPLATE = """\
# Demo corpus: parallel multilingual text from Debian documentation

Real, human-translated text in {n_lang} languages, bundled so that `grape-stream demo` and
`bench/mixture_quality.py` run on any machine without network or apt. It mirrors the GRAPE
paper's wiki40b experiment:

- **sources** ({sources}): high-resource languages, the training domains whose mixture GRAPE
  adapts;
- **targets** ({targets}): low-resource languages, the tasks GRAPE optimises for.

The paper's eighth target, Romanian, is left out: these packages hold only about 0.5 MB of
Romanian text in Romanian (no LibreOffice help; GNOME help is ~2% translated).

*Generated by `scripts/build_demo_corpus.py` (version {version}); do not edit by hand.*

## Layout

`<split>/<lang>.jsonl.zst`: zstd (level {level}) JSON lines, one document per line:

```json
{{"text": "paragraph\\nparagraph...", "lang": "ca", "split": "test", "source": "libreoffice-help", "doc_id": "libreoffice-help:text/scalc/01/05030200"}}
```

- `source` is one of `libreoffice-help`, `manpages`, `installation-guide`, `gnome-user-docs`.
- `doc_id` is `<source>:<page path>`, the same for a page in every language (the corpus is
  parallel); pages longer than {max_doc:,} characters are cut at paragraph boundaries into parts
  `<page>#1`, `<page>#2`, ... (one document each, all in the page's split).
- Splits: **train** (source languages: the training domains; targets: a small extra split, unused
  by default), **probe** (targets only: GRAPE's validation text for the task losses), **test**
  (reporting only; sources carry a small one for source-side perplexity).
- `corpus.json`: languages, roles, per language and split the docs / characters / bytes /
  characters per source package / characters available before the size cut, package versions,
  tool versions, seed and sha256 of every file. `LICENSES.md`: the packages' copyright files.

Reading it needs only `zstandard` (or the `zstd` command line):

```python
import json, zstandard
raw = zstandard.ZstdDecompressor().decompress(open("data/demo/test/ca.jsonl.zst", "rb").read())
docs = [json.loads(line) for line in raw.decode("utf-8").splitlines()]
```

## Contents

| lang | role | split | docs | characters | available | jsonl KB | zst KB |
|---|---|---|---:|---:|---:|---:|---:|
{table}

Total: {n_files} files, {raw_mb:.1f} MB of JSON lines, {zst_mb:.2f} MB compressed.
Characters per source package, per language and split, are in `corpus.json`.

## How it was built

```bash
sudo apt-get update   # Debian 12 "bookworm" package lists
python scripts/build_demo_corpus.py --out data/demo --workdir ~/.cache/grape_stream/debian-docs
```

(`--seed {seed}` and the default size budgets; `--help` lists them.) The script fetches the
packages with `apt-get download` (cached in the work dir) and unpacks them with `dpkg-deb -x`;
nothing is installed. The same package versions (listed in `corpus.json`) and tool versions give
byte-identical output: everything is sorted, hashed with a fixed seed, compressed at a fixed
level, and nothing records a time or a path.

| package | path inside | languages here |
|---|---|---|
| `libreoffice-help-*` | `usr/share/libreoffice/help/<lang>/text/**/*.html` | all but uk |
| `manpages`, `manpages-*` | `usr/share/man/[<lang>/]man*/*.gz` (roff) | all but ca (pt = `manpages-pt-br`) |
| `installation-guide-amd64` | `usr/share/doc/installation-guide-amd64/<lang>/*.html` | all but tr, pl, uk |
| `gnome-user-docs` | `usr/share/help/<lang>/gnome-help/*.page` (Mallard) | all (tr: almost none passes) |

1. **Extraction.** HTML and Mallard pages go through a tag-aware parser: paragraphs end at block
   elements; scripts, navigation, page metadata (`<info>`), code blocks (`<pre>`, `<screen>`,
   Basic code listings) and LibreOffice's hidden per-platform variants are skipped; entities are
   decoded. Man pages go through a small roff reader: text lines and font-macro arguments are
   kept, escapes mapped to characters, other requests and no-fill / example / table / macro
   blocks dropped; mdoc pages and `.so` redirects are skipped. Text is NFC-normalised,
   invisible characters removed, whitespace collapsed.
2. **Filters.** A paragraph is kept if it has at least {min_chars} characters, does not look like
   code or a command line (letters under 65% of non-space characters, over 25% code-like words,
   fewer than 4 words, or a shell prompt), and `langid` restricted to the {n_lang} corpus
   languages labels it as the page's language with probability >= {min_prob}. Translations fall
   back to English in places; this check is what keeps that English out of the targets.
3. **Splits, per page, identical in every language.** A page's split comes from a seeded hash
   of its id, which has no language in it: {pct_test}% of pages are test, {pct_probe}% probe,
   {pct_train}% train. So a page held out for a target's probe or test is held out of every
   language's training text too. Why: the pages are translations of one another; with a split
   per (page, language), the French translation of a Catalan test page would sit in French
   training data, and the Catalan test score would partly measure recall of that page's names,
   numbers and identifiers across languages. Sources still help targets through everything else
   they share: the technical domain, vocabulary, product names and language relatedness, which
   is the transfer GRAPE is meant to find. Test sets of different targets are largely the same
   pages, so per-target scores compare like with like.
4. **Size cut and deduplication.** Documents are taken in seeded hash order, test first, then
   probe, then train, until each split's character budget is met (sources: train
   {b_src_train:,}, test {b_src_test:,}; targets: probe {b_tgt_probe:,}, test {b_tgt_test:,},
   train {b_tgt_train:,}); a paragraph already taken for the language (boilerplate repeated
   across pages) is dropped, so evaluation text never reappears in training text. A split
   overshoots its budget by less than one document.

## Caveats

- **uk** has no LibreOffice help and no installation guide: its text is `manpages-uk` and GNOME
  help, so its test set is smaller (its test pages are few, and one long man page falls in probe).
- **ru**, **es** and **it** train splits are below the source budget: that is all the
  in-language text their train pages hold after deduplication.
- **pt** mixes European Portuguese (LibreOffice, GNOME `pt`, installation guide) with Brazilian
  Portuguese (`manpages-pt-br`).
- The English `manpages` package holds sections 1, 4, 5, 7 and 8 (sections 2 and 3 are in
  `manpages-dev`, not used); translated man pages cover other packages' commands too.
- Technical documentation is a narrow domain: menu paths, option names and product names recur.
  That is realistic for a demo of domain reweighting, but perplexities are not comparable with
  those on general web text.

## Licenses

The text keeps its upstream licenses: MPL-2.0 (some Apache-2.0 material) for LibreOffice help;
GPL translations (GPL-3+ for manpages-l10n) of pages under GPL, BSD, Linux-man-pages-copyleft
and other free licenses for the man pages; GPL-2 for the installation guide; CC-BY-SA-3.0 for GNOME help.
`LICENSES.md` reproduces every package's Debian copyright file verbatim.
"""  # noqa: E501 - the JSON example line above is written verbatim into the corpus README


def write_readme(path: Path, corpus: dict, args: argparse.Namespace) -> None:
    """The corpus card: contents table from the stats just written, and the exact recipe."""
    rows, raw, zst = [], 0, 0
    for lang in corpus["languages"]:
        st = corpus["stats"][lang]
        for split in SPLITS:
            v = st["splits"].get(split)
            if v is None:
                continue
            raw += v["jsonl_bytes"]
            zst += v["zst_bytes"]
            rows.append(f"| {lang} | {st['role']} | {split} | {v['docs']:,} | {v['chars']:,} | "
                        f"{v['available_chars']:,} | {v['jsonl_bytes'] / 1024:,.0f} | "
                        f"{v['zst_bytes'] / 1024:,.0f} |")
    b = corpus["budget_chars"]
    text = README_TEMPLATE.format(
        n_lang=len(corpus["languages"]), sources=", ".join(SOURCES), targets=", ".join(TARGETS),
        version=SCRIPT_VERSION, level=ZSTD_LEVEL, max_doc=MAX_DOC_CHARS, table="\n".join(rows),
        n_files=len(corpus["files"]), raw_mb=raw / 1e6, zst_mb=zst / 1e6, seed=corpus["seed"],
        min_chars=MIN_PARAGRAPH_CHARS, min_prob=corpus["filters"]["langid"]["min_prob"],
        pct_test=SPLIT_PERCENT["test"], pct_probe=SPLIT_PERCENT["probe"],
        pct_train=SPLIT_PERCENT["train"], b_src_train=b["source"]["train"],
        b_src_test=b["source"]["test"], b_tgt_probe=b["target"]["probe"],
        b_tgt_test=b["target"]["test"], b_tgt_train=b["target"]["train"],
    )
    path.write_text(text, encoding="utf-8")


def _tool_versions() -> dict[str, str]:
    """Versions that decide the output bytes besides the packages (zstd, langid's model)."""
    from importlib.metadata import version

    import zstandard

    return {"python": ".".join(map(str, sys.version_info[:2])), "langid": version("langid"),
            "zstandard": version("zstandard"),
            "zstd": ".".join(map(str, zstandard.ZSTD_VERSION))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/demo"), help="output folder")
    ap.add_argument("--workdir", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                    / "grape_stream" / "debian-docs",
                    help="download and unpack cache (reused between runs)")
    ap.add_argument("--offline", action="store_true",
                    help="use the .deb files already in WORKDIR/debs, do not call apt-get")
    ap.add_argument("--seed", type=int, default=0, help="salt of the page hash (splits, order)")
    for (role, split), chars in DEFAULT_BUDGET.items():
        ap.add_argument(f"--{role}-{split}-chars", type=int, default=chars,
                        help=f"characters of text per {role} language in {split} "
                             f"(default {chars:,})")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    budget = {role: {s: getattr(args, f"{role}_{s}_chars") for s in SPLITS}
              for role in ("source", "target")}
    pkgs = packages()
    debs = fetch_packages(pkgs, args.workdir / "debs", args.offline)
    roots = unpack(debs, args.workdir / "unpacked")
    langfilter = LanguageFilter()

    args.out.mkdir(parents=True, exist_ok=True)
    stats: dict[str, dict] = {}
    files: dict[str, dict] = {}
    for lang in tqdm(LANGUAGES, desc="languages", unit="lang", disable=args.no_progress):
        role = "source" if lang in SOURCES else "target"
        sel = select_language(lang, pages_for(lang, roots), budget[role], args.seed, langfilter,
                              progress=not args.no_progress)
        stats[lang] = {"role": role, "splits": {}}
        for split in SPLITS:
            path = args.out / split / f"{lang}.jsonl.zst"
            docs = sel.docs[split]
            if not docs:
                if path.exists():
                    path.unlink()
                continue
            raw, size = write_jsonl_zst(path, docs)
            rel = path.relative_to(args.out).as_posix()
            files[rel] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": size}
            by_source: dict[str, int] = {}
            for d in docs:
                by_source[d["source"]] = by_source.get(d["source"], 0) + len(d["text"])
            stats[lang]["splits"][split] = {
                "docs": len(docs), "chars": sel.chars[split], "jsonl_bytes": raw,
                "zst_bytes": size, "chars_by_source": dict(sorted(by_source.items())),
                "available_chars": sel.available_chars[split],
            }
        if not args.no_progress:
            tqdm.write(f"{lang}: " + ", ".join(
                f"{s} {v['docs']} docs {v['chars'] / 1e3:.0f}k chars {v['zst_bytes'] / 1e3:.0f} KB"
                for s, v in stats[lang]["splits"].items()))

    write_licenses(args.out / "LICENSES.md", roots, pkgs)
    corpus = {
        "name": "grape-stream demo corpus (Debian documentation, parallel multilingual)",
        "script": "scripts/build_demo_corpus.py",
        "script_version": SCRIPT_VERSION,
        "seed": args.seed,
        "languages": list(LANGUAGES),
        "roles": {"sources": list(SOURCES), "targets": list(TARGETS)},
        "splits": list(SPLITS),
        "split_percent_of_pages": SPLIT_PERCENT,
        "budget_chars": budget,
        "format": {"path": "<split>/<lang>.jsonl.zst", "compression": f"zstd level {ZSTD_LEVEL}",
                   "fields": ["text", "lang", "split", "source", "doc_id"]},
        "filters": {"min_paragraph_chars": MIN_PARAGRAPH_CHARS,
                    "langid": {"languages": sorted(LANGUAGES), "min_prob": langfilter.min_prob}},
        "packages": {pkg: roots[pkg][1] for pkg in pkgs},
        "tools": _tool_versions(),
        "stats": stats,
        "files": dict(sorted(files.items())),
    }
    (args.out / "corpus.json").write_text(json.dumps(corpus, indent=2, ensure_ascii=False) + "\n",
                                          encoding="utf-8")
    write_readme(args.out / "README.md", corpus, args)
    total = sum(f["bytes"] for f in files.values())
    print(f"wrote {len(files)} files, {total / 1e6:.2f} MB compressed, to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
