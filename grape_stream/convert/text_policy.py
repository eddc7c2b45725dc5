"""What the converter does with text that cannot be tokenized as is, and how it bounds huge documents.

Web crawls hold lone UTF-16 surrogates (JSON ``"\\ud800"`` decodes to a str that UTF-8 cannot encode),
C0 control characters and NULs. One such record must never abort a conversion: under the default
policy ``repair`` the text is fixed in place (a lone surrogate becomes U+FFFD; NUL and the other C0
control characters are dropped, except tab, newline, carriage return, vertical tab and form feed, the
page break of text extracted from books) and the record is kept and counted as
``repaired_text``; under ``skip`` the record is dropped and counted as ``unencodable_text``; ``--strict``
stops at the first one with file:line and the reason. docs/converters.md states the policy.

Huge documents (a 50 MB log line, a whole book in one record) are tokenized in pieces of at most
``MAX_PIECE_CHARS`` characters, cut only at a single space between two non-space characters: GPT-2-style
byte-level BPE never merges across such a space (its pre-tokenizer starts a new word there), and the byte
tokenizer is position-free, so the token ids are exactly those of the whole text, while the tokenizer's
peak memory stays bounded by one piece. Text with no such space over a whole piece and a little more (CJK
without spaces, base64, a minified blob) is cut at the piece size anyway: the memory bound holds for every
text, and only the one 'word' cut there may tokenize differently from the whole text (the byte tokenizer's
ids stay exact).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["TEXT_POLICIES", "CleanedText", "clean_text", "split_for_tokenizer", "MAX_PIECE_CHARS"]

TEXT_POLICIES = ("repair", "skip")
MAX_PIECE_CHARS = 1 << 20

_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f]")
_CUT = re.compile(r"(?<=\S) (?=\S)")


@dataclass(frozen=True, slots=True)
class CleanedText:
    text: str | None  # None: drop the record
    kind: str | None  # None: the text was fine; else the report kind ("repaired_text" / "unencodable_text")
    reason: str = ""


def _describe(surrogates: int, controls: int) -> str:
    parts = []
    if surrogates:
        parts.append(f"{surrogates} lone surrogate(s) (not encodable as UTF-8)")
    if controls:
        parts.append(f"{controls} control character(s)")
    return " and ".join(parts)


def clean_text(text: str, policy: str = "repair") -> CleanedText:
    """Apply the policy to one document's text; a clean text comes back unchanged (and fast)."""
    if policy not in TEXT_POLICIES:
        raise ValueError(f"text policy must be one of {TEXT_POLICIES}, got {policy!r}")
    if text.isprintable() or not (_SURROGATE.search(text) or _CONTROL.search(text)):
        return CleanedText(text, None)
    surrogates = len(_SURROGATE.findall(text))
    controls = len(_CONTROL.findall(text))
    reason = _describe(surrogates, controls)
    if policy == "skip":
        return CleanedText(None, "unencodable_text", reason)
    fixed = _CONTROL.sub("", _SURROGATE.sub("\ufffd", text))
    return CleanedText(fixed, "repaired_text", reason)


def split_for_tokenizer(text: str, max_chars: int = MAX_PIECE_CHARS) -> list[str]:
    """Pieces of at most ~`max_chars` (1/16 more at most) whose tokenizations concatenate to the whole text's.

    A window with no safe cut point and none in the next ``max_chars // 16`` characters (one 'word' that
    long: CJK, base64) is cut at `max_chars`: the memory bound wins over exact ids there (module doc).
    """
    if len(text) <= max_chars:
        return [text]
    pieces = []
    start = 0
    n = len(text)
    while n - start > max_chars:
        window_end = start + max_chars
        cut = None
        # the last safe cut in the window: search backwards in growing steps (cheap on long texts)
        lo = max(start + 1, window_end - 4096)
        while cut is None:
            for m in _CUT.finditer(text, lo, window_end):
                cut = m.start()
            if lo == start + 1:
                break
            lo = max(start + 1, lo - (window_end - lo))
        if cut is None:  # no cut in the window: the next one just after it, else cut the 'word' itself
            after = _CUT.search(text, window_end, window_end + max(1, max_chars // 16))
            cut = after.start() if after is not None else window_end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces
