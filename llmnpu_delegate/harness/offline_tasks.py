"""Offline lm-eval tasks built from the evaluation text (never the calibration text).

Three tasks in the form of the benchmarks users know, each a JSON-lines file and an lm-eval YAML that
reads it with ``dataset_path: json`` (nothing comes from a hub):

- ``llmnpu_cloze`` (LAMBADA's form): a paragraph whose last word the model must predict. A paragraph
  qualifies when that word is a content word (letters only, at least 4 of them, not a stop word)
  that already appears earlier in the paragraph: the context determines it, as in LAMBADA, whose
  targets are mostly names and nouns mentioned before. Metrics: accuracy (the word is the greedy
  continuation) and perplexity of the word.
- ``llmnpu_wikitext`` (wikitext's form): rolling log-likelihood of whole documents (consecutive
  paragraphs of about 1,000 words); word and byte perplexity, bits per byte.
- ``llmnpu_nextsentence`` (HellaSwag's form): the first sentences of a paragraph and four endings, the
  true next sentence among three drawn from other paragraphs with a similar word count; accuracy and
  length-normalized accuracy.

The files depend on the text only (a seeded ``random.Random``), so every machine builds the same ones.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

from ..paths import atomic_path, cache_dir
from ..text import read_text

TASKS = ("llmnpu_cloze", "llmnpu_wikitext", "llmnpu_nextsentence")
GROUP = "llmnpu_offline"
FORMAT = 3          # bump when the selection rules change: the folder name changes with it

CLOZE_DOCS, NEXT_DOCS, WIKI_DOCS, WIKI_WORDS = 500, 500, 20, 1000
STOP_WORDS = frozenset("""about above after again against also among another because been before being
below between both could does doing down during each either even every from further have having here
into itself just least many more most much must neither other others over same several should since
some such than that their them themselves then there these they this those through under until very
were what when where which while whom whose will with within without would your""".split())

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def sentences(paragraph: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip()]


def cloze_docs(paragraphs: list[str]) -> list[dict]:
    docs = []
    for p in paragraphs:
        words = p.rstrip(" .!?\"')").split(" ")
        target = words[-1]
        context = " ".join(words[:-1])
        if (len(words) < 40 or not target.isalpha() or len(target) < 4 or target.lower() in STOP_WORDS
                or not re.search(rf"\b{re.escape(target)}\b", context, re.IGNORECASE)):
            continue
        docs.append({"context": context, "target": " " + target})
    return _spread(docs, CLOZE_DOCS, seed=1)


def wikitext_docs(paragraphs: list[str]) -> list[dict]:
    docs, page, words = [], [], 0
    for p in paragraphs:
        page.append(p)
        words += len(p.split())
        if words >= WIKI_WORDS:
            docs.append({"page": "\n\n".join(page)})
            page, words = [], 0
    return docs[:: max(1, len(docs) // WIKI_DOCS)][:WIKI_DOCS]


def next_sentence_docs(paragraphs: list[str]) -> list[dict]:
    rng = random.Random(2)
    split = [sentences(p) for p in paragraphs]
    pool = [(i, s) for i, ss in enumerate(split) for s in ss if 8 <= len(s.split()) <= 60]
    docs = []
    for i, ss in enumerate(split):
        if len(ss) < 3 or not 8 <= len(ss[2].split()) <= 60:
            continue
        true = ss[2]
        n = len(true.split())
        near = [s for j, s in rng.sample(pool, 200) if j != i and 0.67 <= len(s.split()) / n <= 1.5]
        if len(near) < 3:
            continue
        endings = near[:3]
        label = rng.randrange(4)
        endings.insert(label, true)
        docs.append({"query": ss[0] + " " + ss[1], "choices": [" " + e for e in endings], "label": label})
    return _spread(docs, NEXT_DOCS, seed=3)


def _spread(docs: list[dict], n: int, seed: int) -> list[dict]:
    """``n`` docs drawn across the whole text (not its first articles), in text order."""
    if len(docs) <= n:
        return docs
    keep = sorted(random.Random(seed).sample(range(len(docs)), n))
    return [docs[i] for i in keep]


_YAML = {
    "llmnpu_cloze": """output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "llmnpu_wikitext": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{page}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
""",
    "llmnpu_nextsentence": """output_type: multiple_choice
doc_to_text: "{{query}}"
doc_to_target: "{{label}}"
doc_to_choice: "choices"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""",
}
_BUILDERS = {"llmnpu_cloze": cloze_docs, "llmnpu_wikitext": wikitext_docs, "llmnpu_nextsentence": next_sentence_docs}


def task_dir(text_file: Path | None = None) -> Path:
    """The folder of the three tasks (YAML + JSON lines) for the evaluation text, built on first use;
    pass it to lm-eval as ``--include_path``."""
    text = read_text(text_file, "eval")
    key = hashlib.sha256(f"{FORMAT}\n{text}".encode()).hexdigest()[:16]
    folder = cache_dir() / "eval_tasks" / key
    if (folder / "done").is_file():
        return folder
    paragraphs = [p.strip() for p in text.split("\n") if p.strip()]
    with atomic_path(folder) as tmp:
        tmp.mkdir()
        for task in TASKS:
            docs = _BUILDERS[task](paragraphs)
            data = folder / f"{task}.jsonl"          # the final path: the YAML outlives the temporary folder
            (tmp / data.name).write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
            (tmp / f"{task}.yaml").write_text(
                f"task: {task}\ntag: [{GROUP}]\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    test: {json.dumps(str(data))}\ntest_split: test\n{_YAML[task]}"
                f"metadata:\n  version: {FORMAT}.0\n  documents: {len(docs)}\n", encoding="utf-8")
        (tmp / "done").write_text(key + "\n")
    return folder
