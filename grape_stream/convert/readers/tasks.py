"""Target-task reader: validation sets in their Hugging Face layouts, turned into the LM text
"question + correct answer" whose loss GRAPE tracks per task.

Each example becomes one sample (padded to seq_len with a loss mask), never packed with others: a task
loss is a mean over examples. Layouts (auto-detected per record from its fields, or forced):

| layout    | fields                                         | text                                          |
|-----------|------------------------------------------------|-----------------------------------------------|
| ai2_arc   | question, choices{text,label}, answerKey       | Question: q\\nAnswer: choice[answerKey]        |
| sciq      | question, correct_answer, support              | support\\nQuestion: q\\nAnswer: correct_answer  |
| piqa      | goal, sol1, sol2, label                        | Question: goal\\nAnswer: sol{label+1}          |
| hellaswag | ctx, endings, label                            | ctx + " " + endings[label]                    |
| logiqa    | context, query, options, correct_option        | Passage: c\\nQuestion: q\\nAnswer: option       |
| gsm8k     | question, answer                               | Question: q\\nAnswer: answer                   |
| math_qa   | Problem, options ("a ) .. , b ) .."), correct  | Question: Problem\\nAnswer: option text        |
| med_qa    | question, options (dict or [{key,value}]),     | Question: q\\nAnswer: answer                   |
|           | answer_idx, answer                             |                                               |
| text      | text                                           | text                                          |
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from grape_stream.convert.formats import iter_parquet_rows

from .base import DOMAIN, DOMAIN_FIELD, SPLIT_FIELD, BadInput, ReaderOption, Record, register
from .generic import FieldsReader, RecordFields, iter_records

__all__ = ["TaskReader", "TASK_LAYOUTS", "detect_layout", "format_example"]


class _Bad(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def _need(obj: dict, key: str) -> Any:
    v = obj.get(key)
    if v is None or (isinstance(v, str) and not v.strip()):
        raise _Bad("missing_field", f"no {key!r} (or empty: a test split without gold answers?)")
    return v


def _str(obj: dict, key: str) -> str:
    v = _need(obj, key)
    if not isinstance(v, str):
        raise _Bad("bad_field", f"{key!r} is a {type(v).__name__}, not a string")
    return v.strip()


def _index(value: Any, n: int, key: str) -> int:
    try:
        i = int(value)
    except (TypeError, ValueError):
        raise _Bad("bad_field", f"{key!r} = {value!r} is not an integer index") from None
    if not 0 <= i < n:
        raise _Bad("bad_field", f"{key!r} = {i} is outside the {n} options")
    return i


def _qa(q: str, a: str) -> str:
    return f"Question: {q}\nAnswer: {a}"


def _ai2_arc(o: dict) -> str:
    choices = _need(o, "choices")
    if (not isinstance(choices, dict) or not isinstance(choices.get("text"), list)
            or not isinstance(choices.get("label"), list)):
        raise _Bad("bad_field", "'choices' is not {text: [...], label: [...]}")
    key = str(_need(o, "answerKey")).strip()
    labels = [str(x) for x in choices["label"]]
    if key not in labels:
        raise _Bad("bad_field", f"answerKey {key!r} not among labels {labels}")
    return _qa(_str(o, "question"), str(choices["text"][labels.index(key)]).strip())


def _sciq(o: dict) -> str:
    support = o.get("support")
    text = _qa(_str(o, "question"), _str(o, "correct_answer"))
    return f"{support.strip()}\n{text}" if isinstance(support, str) and support.strip() else text


def _piqa(o: dict) -> str:
    i = _index(_need(o, "label"), 2, "label")
    return _qa(_str(o, "goal"), _str(o, ("sol1", "sol2")[i]))


def _hellaswag(o: dict) -> str:
    endings = _need(o, "endings")
    if not isinstance(endings, list):
        raise _Bad("bad_field", "'endings' is not a list")
    i = _index(_need(o, "label"), len(endings), "label")
    return f"{_str(o, 'ctx')} {str(endings[i]).strip()}"


def _logiqa(o: dict) -> str:
    options = _need(o, "options")
    if not isinstance(options, list):
        raise _Bad("bad_field", "'options' is not a list")
    i = _index(_need(o, "correct_option"), len(options), "correct_option")
    return f"Passage: {_str(o, 'context')}\n{_qa(_str(o, 'query'), str(options[i]).strip())}"


def _gsm8k(o: dict) -> str:
    return _qa(_str(o, "question"), _str(o, "answer"))


_MATHQA_OPT = re.compile(r"(?:^|,)\s*([a-e])\s*\)\s*")


def _math_qa(o: dict) -> str:
    opts = _need(o, "options")
    if isinstance(opts, list):
        opts = " , ".join(str(x) for x in opts)
    parts = _MATHQA_OPT.split(str(opts))
    table = {parts[i]: parts[i + 1].strip().rstrip(",").strip() for i in range(1, len(parts) - 1, 2)}
    key = str(_need(o, "correct")).strip().lower()
    if key not in table:
        raise _Bad("bad_field", f"correct {key!r} not among options {sorted(table)}")
    return _qa(_str(o, "Problem"), table[key])


def _med_qa(o: dict) -> str:
    q = _str(o, "question")
    ans = o.get("answer")
    if isinstance(ans, str) and ans.strip():
        return _qa(q, ans.strip())
    options = _need(o, "options")
    key = str(_need(o, "answer_idx")).strip()
    if isinstance(options, list):
        options = {str(x.get("key")): x.get("value") for x in options if isinstance(x, dict)}
    if not isinstance(options, dict) or key not in options:
        raise _Bad("bad_field", f"answer_idx {key!r} not among options")
    return _qa(q, str(options[key]).strip())


def _text(o: dict) -> str:
    v = _need(o, "text")
    if not isinstance(v, str):
        raise _Bad("bad_field", f"'text' is a {type(v).__name__}, not a string")
    return v


TASK_LAYOUTS: dict[str, tuple[frozenset[str], Callable[[dict], str]]] = {
    # detection order matters: the more specific layouts first (med_qa and sciq also have `question`)
    "ai2_arc": (frozenset({"question", "choices", "answerKey"}), _ai2_arc),
    "med_qa": (frozenset({"question", "options", "answer_idx"}), _med_qa),
    "sciq": (frozenset({"question", "correct_answer"}), _sciq),
    "piqa": (frozenset({"goal", "sol1", "sol2"}), _piqa),
    "hellaswag": (frozenset({"ctx", "endings"}), _hellaswag),
    "logiqa": (frozenset({"context", "query", "options"}), _logiqa),
    "math_qa": (frozenset({"Problem", "options", "correct"}), _math_qa),
    "gsm8k": (frozenset({"question", "answer"}), _gsm8k),
    "text": (frozenset({"text"}), _text),
}


def detect_layout(obj: dict) -> str | None:
    keys = set(obj)
    for name, (need, _) in TASK_LAYOUTS.items():
        if need <= keys:
            return name
    return None


def format_example(obj: dict, layout: str = "auto") -> str:
    """The LM text of one example; raises ValueError naming what is missing."""
    name = detect_layout(obj) if layout == "auto" else layout
    if name is None:
        raise ValueError(f"no known task layout matches fields {sorted(obj)}")
    try:
        return TASK_LAYOUTS[name][1](obj)
    except _Bad as e:
        raise ValueError(f"{name}: {e}") from None


LAYOUT = ReaderOption(
    "layout", "--layout", "task layout; auto = detected from each record's fields",
    default="auto", choices=("auto", *TASK_LAYOUTS),
)


@register
@dataclass
class TaskReader(FieldsReader):
    """layout: "auto" (per record, from its fields) or one of TASK_LAYOUTS."""

    layout: str = "auto"
    fields: RecordFields = field(default_factory=RecordFields)
    source = "task"
    per_example = True
    patterns = (".jsonl", ".jsonl.zst", ".jsonl.gz", ".parquet")
    options = (LAYOUT, DOMAIN, DOMAIN_FIELD, SPLIT_FIELD)

    def __post_init__(self) -> None:
        if self.layout != "auto" and self.layout not in TASK_LAYOUTS:
            raise ValueError(f"unknown task layout {self.layout!r}; known: auto, {', '.join(TASK_LAYOUTS)}")

    def describe(self) -> dict[str, Any]:
        return {"layout": self.layout, **vars(self.fields)}

    def read(self, path: str) -> Iterator[Record | BadInput]:
        unit = "row" if path.endswith(".parquet") else "line"
        fixed = self.fields.fixed_domain(path)
        for item in iter_records(path, []) if not path.endswith(".parquet") else _all_columns(path):
            if isinstance(item, BadInput):
                yield item
                continue
            idx, obj = item
            name = detect_layout(obj) if self.layout == "auto" else self.layout
            if name is None:
                yield BadInput("missing_field", idx, unit, f"no task layout matches fields {sorted(obj)}")
                continue
            try:
                text = TASK_LAYOUTS[name][1](obj)
            except _Bad as e:
                yield BadInput(e.kind, idx, unit, f"{name}: {e}")
                continue
            ds = self.fields.domain_and_split(obj, idx, unit, fixed)
            if isinstance(ds, BadInput):
                yield ds
                continue
            yield Record(idx, unit, ds[0], text=text, split=ds[1])


def _all_columns(path: str) -> Iterator[tuple[int, dict] | BadInput]:
    return iter_parquet_rows(path, [])
