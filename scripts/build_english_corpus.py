#!/usr/bin/env python3
"""Build the bundled English benchmark corpus (``data/english/``): heterogeneous English *source*
domains and multiple-choice QA *target* tasks, all from Debian packages.

Why this exists: the demo corpus (``data/demo``) mirrors the paper's wiki40b set-up (languages); the
paper's main experiment is a different one: English sources that differ the way SlimPajama's do (code,
manuals, encyclopedic text, books, news, Q&A) and reasoning / QA targets. This script builds that
setting from packages Debian ships, so the benchmark runs offline and needs no apt at run time.

Sources (the domains a mixture reweights), one package family each:

- ``code``: the Python 3.11 standard library's sources (``libpython3.11-stdlib``; GitHub-like);
- ``manuals``: the English Linux man pages (``manpages``; technical documentation);
- ``encyclopedia``: FOLDOC, the Free On-line Dictionary of Computing (``dict-foldoc``; encyclopedic);
- ``dictionary``: Webster's 1913 via GCIDE (``dict-gcide``; reference text, old English prose);
- ``books``: Jane Austen's six novels (``r-cran-janeaustenr``; Project Gutenberg texts);
- ``news``: Reuters-21578 / RCV1 news articles shipped as R ``tm`` examples (``r-cran-tm``);
- ``faq``: the Debian FAQ (``debian-faq``; question-and-answer text).

Targets (question + answer; 4-way multiple choice with distractors drawn from the same task):

- ``trivia``: the BSD games' ``quiz`` files (``bsdgames``): capitals, elements, presidents, ...;
- ``vocab``: WordNet glosses -> the word (``wordnet-base``);
- ``cmdqa``: what a command / call does, from man pages' NAME lines (probe/test pages are held out of
  ``manuals``);
- ``codeqa``: what a standard-library function does, from its docstring's first line (probe/test
  modules are held out of ``code``).

Each target has a ``probe`` split (GRAPE's validation text) and a ``test`` split; the LM text of an item
is ``"Question: <q>\\nAnswer: <a>"``, and the item also carries ``choices`` and ``label`` for
multiple-choice scoring. Output: ``<out>/<split>/<domain>.jsonl.zst`` + corpus.json + README.md +
LICENSES.md. Deterministic: same packages => byte-identical output.

    python scripts/build_english_corpus.py --out data/english --workdir ~/.cache/grape_stream/debian-en
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import random
import re
import struct
import sys
import zlib
from pathlib import Path
from typing import Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_demo_corpus as demo  # noqa: E402  (shared: apt download, unpack, roff/HTML readers, zstd writer)

SCRIPT_VERSION = "1.0.0"
SOURCES = ("code", "manuals", "encyclopedia", "dictionary", "books", "news", "faq")
TARGETS = ("trivia", "vocab", "cmdqa", "codeqa")
PACKAGES = {
    "code": "libpython3.11-stdlib", "manuals": "manpages", "encyclopedia": "dict-foldoc",
    "dictionary": "dict-gcide", "books": "r-cran-janeaustenr", "news": "r-cran-tm", "faq": "debian-faq",
    "trivia": "bsdgames", "vocab": "wordnet-base",
}
EXTRA_PACKAGES = {"manuals": "manpages-dev"}  # sections 2 and 3 (system calls, C library)
SOURCE_TRAIN_CHARS = 1_200_000  # per source domain (~300k GPT-2 tokens); small domains have less
HOLDOUT_PERCENT = 30  # man pages / stdlib modules whose QA items are targets: kept out of the sources
MAX_DOC_CHARS = 8_000
ITEMS = {"trivia": 900, "vocab": 900, "cmdqa": 900, "codeqa": 900}  # at most, before the probe/test split
PROBE_SHARE = 0.4


def h64(key: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"grape-english/{seed}/{key}".encode()).digest()[:8], "big")


def held_out(key: str, seed: int) -> bool:
    """Pages / modules whose QA items become target items (and so are left out of the sources)."""
    return h64("holdout:" + key, seed) % 100 < HOLDOUT_PERCENT


def chunk(paragraphs: Iterable[str], max_chars: int = MAX_DOC_CHARS) -> list[str]:
    out, cur, n = [], [], 0
    for p in paragraphs:
        if cur and n + len(p) > max_chars:
            out.append("\n\n".join(cur))
            cur, n = [], 0
        cur.append(p)
        n += len(p) + 2
    if cur:
        out.append("\n\n".join(cur))
    return out


# ------------------------------------------------------------------------------------ sources
def src_code(root: Path, seed: int) -> list[tuple[str, str]]:
    docs = []
    for f in sorted((root / "usr/lib/python3.11").rglob("*.py")):
        rel = f.relative_to(root / "usr/lib/python3.11").as_posix()
        if held_out(rel, seed) or "/test" in "/" + rel or f.is_symlink():
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        for i, part in enumerate(chunk(text.split("\n\n"))):
            docs.append((f"{rel}#{i}", part))
    return docs


def man_pages(roots: list[Path]) -> list[Path]:
    """Real pages only (``.so`` redirects and symlinks are not pages)."""
    out = []
    for root in roots:
        for p in (root / "usr/share/man").glob("man*/*.gz"):
            if not p.is_symlink() and not demo._read_text(p).lstrip().startswith(".so "):
                out.append(p)
    return sorted(out, key=lambda p: (p.parent.name, p.name))


def src_manuals(root: list[Path], seed: int) -> list[tuple[str, str]]:
    docs = []
    for f in man_pages(root):
        if held_out(f.name, seed):
            continue
        paras = [demo.normalise(p) for p in demo.read_roff(f)]
        for i, part in enumerate(chunk(p for p in paras if len(p) >= 40)):
            docs.append((f"{f.name}#{i}", part))
    return docs


def dict_entries(path: Path) -> list[tuple[str, str]]:
    """dictd .dict.dz (gzip-compatible): an entry starts at a line with no indentation."""
    text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
    entries, head, body = [], None, []
    for line in text.splitlines():
        if line and not line[0].isspace():
            if head is not None and body:
                entries.append((head, " ".join(" ".join(body).split())))
            head, body = line.strip(), []
        elif head is not None and line.strip():
            body.append(line.strip())
    if head is not None and body:
        entries.append((head, " ".join(" ".join(body).split())))
    return [(h, b) for h, b in entries if not h.startswith("00-database") and len(b) >= 40]


def src_dict(root: Path, name: str) -> list[tuple[str, str]]:
    entries = dict_entries(root / f"usr/share/dictd/{name}.dict.dz")
    paras = [f"{h}\n{b}" for h, b in entries]
    return [(f"{name}#{i}", d) for i, d in enumerate(chunk(paras, 4000))]


def r_strings(path: Path) -> list[list[str]]:
    """Character vectors in an R lazy-load database (.rdb: 4-byte length + zlib blocks of R's XDR
    serialisation); enough of the format to read janeaustenr's novels (one string per line)."""
    raw, pos, vectors = path.read_bytes(), 0, []
    while pos < len(raw):
        d = zlib.decompressobj()
        blob = d.decompress(raw[pos + 4:])
        pos += 4 + len(raw) - pos - 4 - len(d.unused_data)
        i = 0
        while i < len(blob) - 8:
            flags, n = struct.unpack(">ii", blob[i:i + 8])
            if flags & 0xFF == 16 and 100 < n < 10**6:  # STRSXP of CHARSXPs
                j, vals, ok = i + 8, [], True
                for _ in range(n):
                    f, ln = struct.unpack(">ii", blob[j:j + 8])
                    if f & 0xFF != 9:
                        ok = False
                        break
                    vals.append("" if ln == -1 else blob[j + 8:j + 8 + ln].decode("utf-8", "replace"))
                    j += 8 + max(ln, 0)
                if ok:
                    vectors.append(vals)
                    i = j
                    continue
            i += 1
    return vectors


def src_books(root: Path) -> list[tuple[str, str]]:
    docs = []
    for lines in r_strings(root / "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"):
        title = lines[0].strip().title().replace(" ", "")
        paras, cur = [], []
        for line in lines + [""]:
            if line.strip():
                cur.append(line.strip())
            elif cur:
                paras.append(" ".join(cur))
                cur = []
        for i, part in enumerate(chunk(paras)):
            docs.append((f"{title}#{i}", part))
    return docs


def src_news(root: Path) -> list[tuple[str, str]]:
    docs = []
    for f in sorted((root / "usr/lib/R/site-library/tm/texts").rglob("*.xml")):
        text = f.read_text(encoding="utf-8", errors="replace")
        for i, m in enumerate(re.finditer(r"<REUTERS.*?</REUTERS>|<newsitem.*?</newsitem>", text, re.S)):
            item = m.group(0)
            title = re.search(r"<(?:TITLE|title)>(.*?)</", item, re.S)
            body = re.findall(r"<BODY>(.*?)</BODY>|<p>(.*?)</p>", item, re.S)
            parts = [" ".join((a or b).split()) for a, b in body]
            # (v1.0.0 keeps the titles' SGML entities, e.g. "&Lt;Acme Inc&Gt;", as the committed corpus has them)
            parts = [demo.normalise(re.sub(r"&#\d+;|&lt;|&gt;|&amp;", " ", p)) for p in parts if p]
            if parts:
                head = " ".join(title.group(1).split()).title() if title else ""
                docs.append((f"{f.relative_to(root).as_posix()}#{i}", "\n\n".join([head] + parts).strip()))
    return docs


def src_faq(root: Path) -> list[tuple[str, str]]:
    docs = []
    for f in sorted((root / "usr/share/doc/debian/FAQ").glob("*.en.html")):
        paras = [demo.normalise(p) for p in demo.read_markup(f)]
        for i, part in enumerate(chunk(p for p in paras if len(p) >= 20)):
            docs.append((f"{f.name}#{i}", part))
    return docs


# ------------------------------------------------------------------------------------ targets
def quiz_first(s: str) -> str:
    """bsdgames quiz syntax: 'a|b' alternatives (take the first), '[x|y]' (first), '{opt}' (kept)."""
    depth, cut = 0, len(s)
    for i, c in enumerate(s):
        depth += c in "[{"
        depth -= c in "]}"
        if c == "|" and depth == 0:
            cut = i
            break
    s = s[:cut]
    while "[" in s:
        s = re.sub(r"\[([^\[\]|]*)(\|[^\[\]]*)?\]", r"\1", s)
    return " ".join(s.replace("{", "").replace("}", "").replace("\\", "").split())


TRIVIA = {  # file: (question column, answer column, template)
    "africa": (0, 1, "What is the capital of {}?"), "america": (0, 1, "What is the capital of {}?"),
    "asia": (0, 1, "What is the capital of {}?"), "europe": (0, 1, "What is the capital of {}?"),
    "state": (0, 1, "What is the capital of the US state of {}?"),
    "province": (0, 1, "What is the capital of the Canadian province of {}?"),
    "elements": (0, 3, "Which chemical element has the symbol {}?"),
    "collectives": (0, 1, "What is the collective noun for a group of {}?"),
    "babies": (0, 1, "A young {} grows up into which animal?"),
    "sexes": (0, 1, "What is the female counterpart of a {}?"),
    "latin": (0, 1, "What does the Latin word \"{}\" mean in English?"),
    "greek": (0, 1, "What does the Greek word \"{}\" mean in English?"),
    "flowers": (0, 1, "In the language of flowers, what does the {} mean?"),
    "pres": (0, 3, "Who succeeded {} as President of the United States?"),
    "murders": (0, 1, "Who killed {}?"),
}


def tgt_trivia(root: Path) -> list[tuple[str, str, str, str]]:
    items = []
    for name, (qc, ac, tmpl) in TRIVIA.items():
        text = (root / "usr/share/games/bsdgames/quiz" / name).read_text(encoding="latin-1")
        for line in text.replace("\\\n", "").splitlines():
            cols = re.split(r"(?<!\\):", line)
            if len(cols) <= max(qc, ac):
                continue
            q, a = quiz_first(cols[qc]), quiz_first(cols[ac])
            if q and a and q != a:
                items.append((f"{name}:{q}", name, tmpl.format(q), a))
    return items


def tgt_vocab(root: Path) -> list[tuple[str, str, str, str]]:
    items = []
    for pos in ("noun", "verb", "adj"):
        for line in (root / f"usr/share/wordnet/data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith(" ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            word = parts[4].replace("_", " ")
            if "(" in word or not word.isalpha() or not word.islower() or len(word) < 4:
                continue
            definition = gloss.split(";")[0].strip()
            if len(definition) < 15 or word in definition:
                continue
            items.append((f"{pos}:{parts[0]}", pos, f"Which word means \"{definition}\"?", word))
    return items


def tgt_cmdqa(root: list[Path], seed: int) -> list[tuple[str, str, str, str]]:
    items = []
    for f in man_pages(root):
        if not held_out(f.name, seed):
            continue
        text = demo._read_text(f)
        m = re.search(r'^\.SH\s+"?NAME"?\s*\n(.+?)\n\.(?:SH|SS)', text, re.M | re.S)
        if not m:
            continue
        line = demo.normalise(demo.roff_unescape(" ".join(x for x in m.group(1).splitlines()
                                                          if not x.startswith("."))))
        if " - " not in line:
            continue
        names, desc = line.split(" - ", 1)
        name = names.split(",")[0].strip()
        kind = "command" if f.parent.name in ("man1", "man8") else "function" if f.parent.name in (
            "man2", "man3") else "file or topic"
        if name and len(desc) >= 8:
            items.append((f.name, f.parent.name, f"What does the Linux {kind} `{name}` do?", desc.strip()))
    return items


def tgt_codeqa(root: Path, seed: int) -> list[tuple[str, str, str, str]]:
    items = []
    base = root / "usr/lib/python3.11"
    for f in sorted(base.rglob("*.py")):
        rel = f.relative_to(base).as_posix()
        if not held_out(rel, seed) or "/test" in "/" + rel or f.is_symlink():
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                first = demo.normalise(doc.strip().split("\n\n")[0]) if doc else ""
                if 15 <= len(first) <= 200:
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    items.append((f"{rel}:{node.name}", mod,
                                  f"What does the Python {kind} `{mod}.{node.name}` do?", first))
    return items


def mc_items(raw: list[tuple[str, str, str, str]], task: str, seed: int, limit: int) -> dict[str, list[dict]]:
    """Deduplicate, take ``limit`` items in hash order, add 3 distractors (answers of other items of the
    same group where possible), shuffle the options, split probe/test by item hash."""
    seen, uniq = set(), []
    for key, group, q, a in sorted(raw, key=lambda r: h64(task + r[0], seed)):
        if q not in seen:
            seen.add(q)
            uniq.append((key, group, q, a))
    uniq = uniq[:limit]
    answers_by_group: dict[str, list[str]] = {}
    for _, g, _, a in uniq:
        answers_by_group.setdefault(g, []).append(a)
    every = sorted({a for _, _, _, a in uniq})
    out: dict[str, list[dict]] = {"probe": [], "test": []}
    for key, group, q, a in uniq:
        rng = random.Random(h64("mc:" + task + key, seed))
        pool = sorted({x for x in answers_by_group[group] if x != a})
        if len(pool) < 3:
            pool = sorted({x for x in every if x != a})
        choices = rng.sample(pool, 3) + [a]
        rng.shuffle(choices)
        split = "probe" if h64("split:" + task + key, seed) % 1000 < PROBE_SHARE * 1000 else "test"
        out[split].append({"text": f"Question: {q}\nAnswer: {a}", "domain": task, "split": split,
                           "source": PACKAGES.get(task, "manpages" if task == "cmdqa" else
                                                  "libpython3.11-stdlib"),
                           "doc_id": f"{task}:{key}", "question": q, "choices": choices,
                           "label": choices.index(a)})
    return out


# ------------------------------------------------------------------------------------ output
def select_source(docs: list[tuple[str, str]], name: str, seed: int, budget: int) -> list[dict]:
    """Documents in seeded hash order until the character budget is met (exact duplicates dropped)."""
    out, seen, n = [], set(), 0
    for doc_id, text in sorted(docs, key=lambda d: h64(name + d[0], seed)):
        if n >= budget:
            break
        if text in seen or not text.strip():
            continue
        seen.add(text)
        out.append({"text": text, "domain": name, "split": "train", "source": PACKAGES[name],
                    "doc_id": f"{name}:{doc_id}"})
        n += len(text)
    return sorted(out, key=lambda d: d["doc_id"])


LICENSE_HEAD = """# Licenses of the English benchmark corpus

The text in `data/english/` is extracted from the Debian 12 ("bookworm") packages below by
`scripts/build_english_corpus.py` (markup removed, documents selected, QA items formatted with
distractors). Each package's Debian copyright file is reproduced verbatim below and is authoritative.
In short: Python standard library: PSF-2.0; Linux man pages: Linux-man-pages-copyleft, GPL, BSD and
others per page; FOLDOC: GFDL-1.1+; GCIDE (Webster's 1913 + additions): GPL-3+; Jane Austen's novels:
public domain (packaged MIT by janeaustenr); R tm's Reuters-21578 / RCV1 samples: GPL (package), the
Reuters-21578 collection is free for research use; Debian FAQ: GPL-2+; BSD games quiz files: BSD;
WordNet 3.0: the WordNet licence (permissive, BSD-like).

| package | version | used for |
|---|---|---|
"""


def write_licenses(path: Path, roots: dict[str, tuple[Path, str]], used_for: dict[str, list[str]]) -> None:
    out = [LICENSE_HEAD]
    for pkg in sorted(roots):
        out.append(f"| `{pkg}` | {roots[pkg][1]} | {', '.join(used_for[pkg])} |\n")
    for pkg in sorted(roots):
        f = roots[pkg][0] / "usr/share/doc" / pkg / "copyright"
        text = f.read_text(encoding="utf-8", errors="replace") if f.is_file() else "(no copyright file)"
        out.append(f"\n## {pkg}\n\n````text\n{text.rstrip()}\n````\n")
    path.write_text("".join(out), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/english"))
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache/grape_stream/debian-en")
    ap.add_argument("--offline", action="store_true", help="use .deb files already in WORKDIR/debs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source-chars", type=int, default=SOURCE_TRAIN_CHARS)
    args = ap.parse_args(argv)
    pkgs = sorted(set(PACKAGES.values()) | set(EXTRA_PACKAGES.values()))
    roots = demo.unpack(demo.fetch_packages(pkgs, args.workdir / "debs", args.offline), args.workdir / "unpacked")
    root = {name: roots[pkg][0] for name, pkg in PACKAGES.items()}
    s = args.seed
    man_roots = [root["manuals"], roots[EXTRA_PACKAGES["manuals"]][0]]
    sources = {
        "code": src_code(root["code"], s), "manuals": src_manuals(man_roots, s),
        "encyclopedia": src_dict(root["encyclopedia"], "foldoc"),
        "dictionary": src_dict(root["dictionary"], "gcide"), "books": src_books(root["books"]),
        "news": src_news(root["news"]), "faq": src_faq(root["faq"]),
    }
    targets = {
        "trivia": tgt_trivia(root["trivia"]), "vocab": tgt_vocab(root["vocab"]),
        "cmdqa": tgt_cmdqa(man_roots, s), "codeqa": tgt_codeqa(root["code"], s),
    }
    files, stats = {}, {}
    outputs: list[tuple[str, str, list[dict]]] = []
    for name, docs in sources.items():
        outputs.append((name, "train", select_source(docs, name, s, args.source_chars)))
    for name, raw in targets.items():
        for split, items in mc_items(raw, name, s, ITEMS[name]).items():
            outputs.append((name, split, items))
    for name, split, docs in outputs:
        path = args.out / split / f"{name}.jsonl.zst"
        raw_bytes, size = demo.write_jsonl_zst(path, docs)
        files[f"{split}/{name}.jsonl.zst"] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                              "bytes": size}
        stats.setdefault(name, {})[split] = {"docs": len(docs), "chars": sum(len(d["text"]) for d in docs),
                                             "jsonl_bytes": raw_bytes, "zst_bytes": size}
        print(f"{split:>5}/{name:<12} {len(docs):>6} docs {stats[name][split]['chars'] / 1e3:>8.0f}k chars "
              f"{size / 1e3:>6.0f} KB")
    used_for: dict[str, list[str]] = {}
    for name, pkg in PACKAGES.items():
        used_for.setdefault(pkg, []).append(name)
    used_for["manpages"].append("cmdqa")
    used_for["manpages-dev"] = ["manuals", "cmdqa"]
    used_for["libpython3.11-stdlib"].append("codeqa")
    write_licenses(args.out / "LICENSES.md", {p: roots[p] for p in pkgs}, used_for)
    corpus = {
        "name": "grape-stream English benchmark corpus (heterogeneous sources, multiple-choice QA targets)",
        "script": "scripts/build_english_corpus.py", "script_version": SCRIPT_VERSION, "seed": s,
        "domain_field": "domain", "split_field": "split", "tokenizer": "gpt2",
        "roles": {"sources": list(SOURCES), "targets": list(TARGETS)},
        "languages": list(SOURCES + TARGETS),  # the demo's key for "every domain", kept for shared tooling
        "format": {"path": "<split>/<domain>.jsonl.zst", "compression": f"zstd level {demo.ZSTD_LEVEL}",
                   "fields": ["text", "domain", "split", "source", "doc_id"],
                   "target_fields": ["question", "choices", "label"],
                   "lm_text": "Question: <question>\\nAnswer: <choices[label]>"},
        "holdout_percent": HOLDOUT_PERCENT, "probe_share": PROBE_SHARE,
        "packages": {p: roots[p][1] for p in pkgs}, "stats": stats, "files": dict(sorted(files.items())),
    }
    (args.out / "corpus.json").write_text(json.dumps(corpus, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(files)} files, {sum(f['bytes'] for f in files.values()) / 1e6:.2f} MB to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
