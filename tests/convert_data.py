"""Small inputs in the exact published layouts (DATA.md), built by the converter tests themselves.

Text is real-looking prose in several scripts (so byte-level and BPE round trips are exercised on
multi-byte UTF-8), generated deterministically from a seed.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

SENTENCES = [
    "The committee published its annual report on regional water quality in March.",
    "Researchers measured the thermal conductivity of the alloy at several temperatures.",
    "In 1887 the railway reached the valley, and the village grew into a market town.",
    "She argued that the proof relies on a compactness argument that does not generalise.",
    "def tokenize(text):\n    return [t for t in text.split() if t]",
    "The museum's collection includes manuscripts, maps and early photographs.",
    "Prices rose by 3.2% over the quarter, driven mostly by energy costs.",
    "Mix the flour with the butter until the texture resembles coarse breadcrumbs.",
    "La bibliothèque municipale ouvre ses portes à neuf heures du matin.",
    "Die Übersetzung wurde 1923 in Zürich veröffentlicht und später überarbeitet.",
    "El río atraviesa la ciudad de norte a sur antes de llegar al mar.",
    "Москва — столица России и крупнейший город страны.",
    "東京は日本の首都であり、多くの博物館がある。",
    "Q: How do I reset the counter?\nA: Call reset() before the loop starts.",
    "Theorem 2. Every bounded monotone sequence of real numbers converges.",
    "The patient presented with fever, cough and shortness of breath.",
    "Volunteers planted four hundred trees along the river bank last spring.",
    "The spacecraft entered orbit after a burn lasting six minutes — a record.",
    "Emoji in user reviews 👍 are common, so tokenizers must handle them ✓.",
    "Warning: the configuration file is missing the 'timeout' key; using 30 s.",
]

SLIMPAJAMA_DOMAINS = (
    "RedPajamaCommonCrawl", "RedPajamaC4", "RedPajamaGithub", "RedPajamaBook",
    "RedPajamaArXiv", "RedPajamaWikipedia", "RedPajamaStackExchange",
)


def make_docs(n: int, seed: int, *, min_sent: int = 1, max_sent: int = 6) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(SENTENCES) for _ in range(rng.randint(min_sent, max_sent))) for _ in range(n)]


def write_zst(path: Path, lines: Sequence[bytes], *, checksum: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join(line + b"\n" for line in lines)
    path.write_bytes(zstandard.ZstdCompressor(write_checksum=checksum).compress(data))
    return path


def write_jsonl(path: Path, records: Sequence[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


def slimpajama_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed + 1000)
    return [{"text": t, "meta": {"redpajama_set_name": rng.choice(SLIMPAJAMA_DOMAINS)}} for t in make_docs(n, seed)]


def write_slimpajama_tree(root: Path, *, files: int = 2, per_file: int = 150, seed: int = 0) -> dict[str, list[dict]]:
    """`train/chunk{c}/example_train_{n}.jsonl.zst` (and nothing else); returns {relpath: records}."""
    out = {}
    for i in range(files):
        rel = f"train/chunk{1 + i // 2}/example_train_{i % 2}.jsonl.zst"
        recs = slimpajama_records(per_file, seed + i)
        write_zst(root / rel, [json.dumps(r, ensure_ascii=False).encode() for r in recs])
        out[rel] = recs
    return out


def write_slimpajama_parquet(path: Path, records: list[dict], *, meta_as_string: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if meta_as_string:
        table = pa.table({"text": [r["text"] for r in records], "meta": [json.dumps(r["meta"]) for r in records]})
    else:
        table = pa.table({
            "text": [r["text"] for r in records],
            "meta": pa.array([r["meta"] for r in records], type=pa.struct([("redpajama_set_name", pa.string())])),
        })
    pq.write_table(table, path, row_group_size=64)
    return path


def gpt2_docs(n: int, seed: int) -> list[list[int]]:
    from grape_stream.convert.tokenization import load_tokenizer

    tok = load_tokenizer("gpt2")
    return [a.astype(int).tolist() for a in tok.encode_batch(make_docs(n, seed))]


def write_climblab_tree(root: Path, *, clusters: Sequence[int] = (1, 2), files: int = 2, per_file: int = 60,
                        seed: int = 0) -> dict[str, list[list[int]]]:
    """`cluster_{k}/cluster_{k}_{NNN}.tokenized.parquet` with `tokens` list<int64> + `token_count`."""
    out = {}
    for k in clusters:
        for j in range(files):
            rel = f"cluster_{k}/cluster_{k}_{j:03d}.tokenized.parquet"
            docs = gpt2_docs(per_file, seed + 100 * k + j)
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            table = pa.table({
                "tokens": pa.array(docs, type=pa.list_(pa.int64())),
                "token_count": pa.array([len(d) for d in docs], type=pa.int64()),
            })
            pq.write_table(table, root / rel, row_group_size=32)
            out[rel] = docs
    return out


def write_wiki40b(root: Path, lang: str, split: str, articles: list[tuple[str, list[tuple[str, list[str]]]]]) -> Path:
    """`<lang>/<split>-00000-of-00001.parquet` with wikidata_id, text (with markers), version_id."""
    texts = []
    for title, sections in articles:
        t = f"\n_START_ARTICLE_\n{title}\n"
        for sec, paras in sections:
            if sec:
                t += f"_START_SECTION_\n{sec}\n"
            t += "_START_PARAGRAPH_\n" + "_NEWLINE_".join(paras) + "\n"
        texts.append(t)
    path = root / lang / f"{split}-00000-of-00001.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "wikidata_id": [f"Q{100 + i}" for i in range(len(texts))],
        "text": texts,
        "version_id": [str(10**12 + i) for i in range(len(texts))],
    }), path)
    return path


def wiki_articles(n: int, seed: int) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    rng = random.Random(seed)
    arts = []
    for i in range(n):
        secs = [("", [rng.choice(SENTENCES)])]
        for s in range(rng.randint(1, 3)):
            secs.append((f"Section {s}", [rng.choice(SENTENCES) for _ in range(rng.randint(1, 3))]))
        arts.append((f"Article {seed}-{i}", secs))
    return arts


def task_examples() -> dict[str, list[dict]]:
    """Three examples per task layout, as their Hugging Face validation sets have them."""
    return {
        "ai2_arc": [
            {"id": "Mercury_1", "question": "Which gas do plants absorb from the air?",
             "choices": {"text": ["oxygen", "carbon dioxide", "nitrogen", "helium"], "label": ["A", "B", "C", "D"]},
             "answerKey": "B"},
            {"id": "Mercury_2", "question": "What is the boiling point of water at sea level?",
             "choices": {"text": ["50 °C", "100 °C", "150 °C"], "label": ["1", "2", "3"]}, "answerKey": "2"},
            {"id": "Mercury_3", "question": "Which organ pumps blood?",
             "choices": {"text": ["lung", "heart", "liver", "kidney"], "label": ["A", "B", "C", "D"]},
             "answerKey": "B"},
        ],
        "sciq": [
            {"question": "What type of organism is commonly used in preparation of foods such as cheese?",
             "distractor1": "viruses", "distractor2": "protozoa", "distractor3": "gymnosperms",
             "correct_answer": "mesophilic organisms", "support": "Mesophiles grow best in moderate temperature."},
            {"question": "What is the least dangerous radioactive decay?", "distractor1": "beta",
             "distractor2": "gamma", "distractor3": "zeta", "correct_answer": "alpha decay", "support": ""},
            {"question": "What do we call the study of heredity?", "distractor1": "ecology",
             "distractor2": "botany", "distractor3": "zoology", "correct_answer": "genetics",
             "support": "Heredity is studied in genetics."},
        ],
        "piqa": [
            {"goal": "How do I ready a guinea pig cage for its new occupants?",
             "sol1": "Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips.",
             "sol2": "Provide the guinea pig with a cage full of a few inches of bedding made of ripped jeans "
                     "material.",
             "label": 0},
            {"goal": "To open a jar lid that is stuck,", "sol1": "tap it with a spoon and twist.",
             "sol2": "freeze the jar overnight.", "label": 0},
            {"goal": "To dry wet shoes quickly,", "sol1": "put them in the oven at 250 °C.",
             "sol2": "stuff them with newspaper.", "label": 1},
        ],
        "hellaswag": [
            {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
             "ctx": "A man is sitting on a roof. he",
             "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                         "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
             "source_id": "activitynet~v_-JhWjGDPHMY", "split": "val", "split_type": "indomain", "label": "3"},
            {"ind": 92, "activity_label": "Baking cookies", "ctx_a": "A woman mixes dough.", "ctx_b": "she",
             "ctx": "A woman mixes dough. she",
             "endings": ["rolls it flat.", "throws it away.", "paints it.", "sings."],
             "source_id": "x", "split": "val", "split_type": "indomain", "label": "0"},
            {"ind": 93, "activity_label": "Running", "ctx_a": "A man ties his shoes.", "ctx_b": "he",
             "ctx": "A man ties his shoes. he", "endings": ["runs down the road.", "eats soup.", "sleeps.", "cries."],
             "source_id": "y", "split": "val", "split_type": "indomain", "label": 0},
        ],
        "logiqa": [
            {"context": "All students in the class passed the exam. Tom is a student in the class.",
             "query": "Which of the following must be true?",
             "options": ["Tom failed.", "Tom passed the exam.", "Tom did not sit the exam.", "Nobody passed."],
             "correct_option": 1},
            {"context": "If it rains, the match is cancelled. The match was not cancelled.",
             "query": "What follows?",
             "options": ["It rained.", "It did not rain.", "The match was cancelled.", "Unknown."],
             "correct_option": 1},
            {"context": "Some birds cannot fly. Penguins are birds.", "query": "Which is consistent?",
             "options": ["Penguins cannot fly.", "No birds fly.", "All birds fly.", "Penguins are fish."],
             "correct_option": 0},
        ],
        "gsm8k": [
            {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
                         "in May. How many clips did Natalia sell altogether in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                       "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
            {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                         "How much did she earn?",
             "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
                       "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
            {"question": "What is 7 times 6?", "answer": "7 * 6 = <<7*6=42>>42\n#### 42"},
        ],
        "math_qa": [
            {"Problem": "the banker ' s gain of a certain sum due 3 years hence at 10 % per annum is rs . 36 . "
                        "what is the present worth ?",
             "Rationale": "\"explanation : t = 3 years r = 10 % ...\"",
             "options": "a ) rs . 400 , b ) rs . 300 , c ) rs . 500 , d ) rs . 350 , e ) none of these",
             "correct": "a",
             "annotated_formula": "divide(multiply(const_100, divide(multiply(36, const_100), multiply(3, 10))), "
                                  "multiply(3, 10))",
             "linear_formula": "multiply(n2,const_100)|", "category": "gain"},
            {"Problem": "what is 15 % of 200 ?", "Rationale": "",
             "options": "a ) 20 , b ) 30 , c ) 40 , d ) 25 , e ) 35",
             "correct": "b", "annotated_formula": "", "linear_formula": "", "category": "general"},
            {"Problem": "a train travels 60 km in 1.5 hours . what is its speed ?", "Rationale": "",
             "options": "a ) 30 kmph , b ) 45 kmph , c ) 40 kmph , d ) 50 kmph , e ) 60 kmph", "correct": "c",
             "annotated_formula": "", "linear_formula": "", "category": "physics"},
        ],
        "med_qa": [
            {"question": "A 23-year-old pregnant woman at 22 weeks gestation presents with burning upon urination. "
                         "Which of the following is the best treatment?",
             "answer": "Nitrofurantoin",
             "options": {"A": "Ampicillin", "B": "Ceftriaxone", "C": "Doxycycline", "D": "Nitrofurantoin"},
             "meta_info": "step2&3", "answer_idx": "D"},
            {"question": "Which vitamin deficiency causes scurvy?", "answer": "",
             "options": [{"key": "A", "value": "Vitamin A"}, {"key": "B", "value": "Vitamin C"}],
             "meta_info": "step1", "answer_idx": "B"},
            {"question": "Which nerve innervates the diaphragm?", "answer": "Phrenic nerve",
             "options": {"A": "Vagus nerve", "B": "Phrenic nerve"}, "meta_info": "step1", "answer_idx": "B"},
        ],
    }


EXPECTED_TASK_TEXT = {
    "ai2_arc": "Question: Which gas do plants absorb from the air?\nAnswer: carbon dioxide",
    "sciq": "Mesophiles grow best in moderate temperature.\n"
            "Question: What type of organism is commonly used in preparation of foods such as cheese?\n"
            "Answer: mesophilic organisms",
    "piqa": "Question: How do I ready a guinea pig cage for its new occupants?\n"
            "Answer: Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips.",
    "hellaswag": "A man is sitting on a roof. he starts pulling up roofing on a roof.",
    "logiqa": "Passage: All students in the class passed the exam. Tom is a student in the class.\n"
              "Question: Which of the following must be true?\nAnswer: Tom passed the exam.",
    "gsm8k": "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?\n"
             "Answer: Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
             "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    "math_qa": "Question: the banker ' s gain of a certain sum due 3 years hence at 10 % per annum is rs . 36 . "
               "what is the present worth ?\nAnswer: rs . 400",
    "med_qa": "Question: A 23-year-old pregnant woman at 22 weeks gestation presents with burning upon urination. "
              "Which of the following is the best treatment?\nAnswer: Nitrofurantoin",
}


def read_mds(path: str | os.PathLike, cache: str | os.PathLike | None = None) -> list[dict[str, np.ndarray]]:
    """Every sample of an MDS dataset in order, through streaming.StreamingDataset.

    `path` (a directory or s3:// URL) is read as the remote, into a fresh local cache: reading never
    writes into the converter's output (a local-only StreamingDataset decompresses shards in place).
    """
    import tempfile

    from streaming import StreamingDataset

    cache = str(cache) if cache else tempfile.mkdtemp(prefix="mds_read_")
    from grape_stream.streaming_compat.registration import create_registered
    from grape_stream.streaming_compat.shm import release_streaming_dataset

    # under the registration lock: a multi-rank job on the other xdist worker must not pick this prefix meanwhile
    ds = create_registered(lambda: StreamingDataset(remote=str(path), local=cache, shuffle=False, batch_size=1))
    try:
        return [ds[i] for i in range(len(ds))]
    finally:
        release_streaming_dataset(ds)  # streaming keeps a dataset's segments (and descriptors) until exit


def expected_packed(docs: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> np.ndarray:
    """The slow reference for one (unit, domain): each doc + EOS, concatenated, cut to full rows."""
    stream: list[int] = []
    for d in docs:
        stream.extend(int(x) for x in d)
        if not (len(d) and int(d[-1]) == eos_id):
            stream.append(eos_id)
    n = len(stream) // seq_len
    return np.array(stream[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


def tree_bytes(root: str | os.PathLike) -> dict[str, bytes]:
    """relpath -> content of every file under root (to compare outputs byte for byte)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out
