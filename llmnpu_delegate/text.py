"""The default calibration and evaluation text, extracted from the gensim 4.4.0 wheel.

Calibration text: the Lee news corpus (``lee_background.cor``).
Evaluation text:  prose paragraphs of the shortened English Wikipedia dump.
Two different sources, so calibration never sees evaluation text.

The text lives in ``text_dir()``: ``LLMNPU_DATA_DIR`` when set, else ``text/`` in the cache folder.
It is prepared on first use (pip fetches the wheel from the package index; nothing else is
downloaded) or ahead of time with ``llmnpu prepare-text [--wheel FILE]``.
"""
from __future__ import annotations

import bz2
import html
import io
import os
import re
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import torch
from torch import Tensor

from .errors import LlmNpuError
from .paths import atomic_path, cache_dir

GENSIM = "gensim==4.4.0"
WIKI = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE = "gensim/test/test_data/lee_background.cor"
MIN_WORDS = 20  # shorter lines are list items, captions and headings, not prose

# Short chat questions for the accuracy checks of whole answers (greedy and teacher-forced agreement
# with the float model): the test gate, benchmarks/greedy_agreement.py and program_parity.py
CHAT_QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.",
                  "Explain photosynthesis in one sentence.", "What is 12 times 7?",
                  "Give me a tip for learning Python.")


def _strip_nested(text: str, pattern: str) -> str:
    rx = re.compile(pattern, re.S)
    while True:
        new = rx.sub("", text)
        if new == text:
            return new
        text = new


def wiki_to_prose(markup: str) -> list[str]:
    t = re.sub(r"<!--.*?-->", "", markup, flags=re.S)
    t = re.sub(r"<ref[^>]*/>", "", t)
    t = re.sub(r"<ref[^>]*>.*?</ref>", "", t, flags=re.S)
    t = _strip_nested(t, r"\{\{[^{}]*\}\}")          # templates, innermost first
    t = _strip_nested(t, r"\{\|[^{}]*?\|\}")          # tables
    for _ in range(5):                                # links, innermost first
        t = re.sub(r"\[\[(?:File|Image|Category|[a-z\-]{2,12}):[^\[\]]*\]\]", "", t)
        t = re.sub(r"\[\[[^\[\]|]*\|([^\[\]]*)\]\]", r"\1", t)
        t = re.sub(r"\[\[([^\[\]]*)\]\]", r"\1", t)
    t = re.sub(r"\[https?://\S+\s([^\]]*)\]", r"\1", t)
    t = re.sub(r"\[https?://[^\]]*\]", "", t)
    t = re.sub(r"'{2,}", "", t)
    t = html.unescape(t)
    t = re.sub(r"<[^>]+>", "", t)
    out = []
    for line in t.split("\n"):
        line = line.strip()
        if not line or line[0] in "=*#:;|!{}[" or "|" in line:
            continue
        line = re.sub(r"\s+", " ", line)
        line = re.sub(r"\(\s*[,;]?\s*\)", "", line)    # "( )" left by removed templates
        if len(line.split()) >= MIN_WORDS:
            out.append(line)
    return out


def wiki_paragraphs(raw_bz2: bytes) -> list[str]:
    paras: list[str] = []
    stream = io.BytesIO(bz2.decompress(raw_bz2))
    for _, elem in ET.iterparse(stream, events=("end",)):
        if elem.tag.endswith("}page"):
            ns = next((c.text for c in elem if c.tag.endswith("}ns")), "0")
            rev = next((c for c in elem if c.tag.endswith("}revision")), None)
            text = None if rev is None else next((c.text for c in rev if c.tag.endswith("}text")), None)
            if ns == "0" and text and not text.lstrip().lower().startswith("#redirect"):
                paras.extend(wiki_to_prose(text))
            elem.clear()
    return paras


ROLES = {"calib": "calib.txt", "eval": "eval.txt"}
_lock = threading.Lock()


def text_dir() -> Path:
    """Folder of the default texts: ``LLMNPU_DATA_DIR``, else ``text/`` in the cache folder."""
    env = os.environ.get("LLMNPU_DATA_DIR")
    return Path(env) if env else cache_dir() / "text"


def default_text_file(role: str) -> Path:
    """The default text for ``role`` ("calib" or "eval"), prepared on first use."""
    folder = text_dir()
    path = folder / ROLES[role]
    if not path.is_file():
        if os.environ.get("LLMNPU_DATA_DIR"):
            raise LlmNpuError(f"default {role} text {path} is missing: LLMNPU_DATA_DIR must hold calib.txt and "
                              f"eval.txt (`llmnpu prepare-text --out {folder}` writes them), or pass a text file")
        with _lock:
            if not path.is_file():
                prepare_text(folder)
    return path


def read_text(path: Path | None, role: str) -> str:
    """Text of ``path``, or the shipped default for ``role`` ("calib" or "eval")."""
    path = Path(path) if path is not None else default_text_file(role)
    if not path.is_file():
        raise LlmNpuError(f"text file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise LlmNpuError(f"text file {path} is empty: give a file with prose")
    return text


def tokenize(lm, text: str) -> Tensor:
    """``text`` as token ids (no special tokens) with the tokenizer of ``lm`` (a ``LoadedModel``)."""
    if lm.tokenizer is None:
        raise LlmNpuError(f"model '{lm.spec}' has no tokenizer: give a model folder with tokenizer files")
    ids = lm.tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def calibration_ids(lm, path: Path | None = None) -> Tensor:
    """The calibration token stream: the text of ``path``, or the shipped calibration text in which, when
    the tokenizer has a chat template, every other paragraph is wrapped in it as a user turn (chat is
    the main job, and its special tokens and role headers shape the activations too)."""
    text = read_text(path, "calib")
    tok = lm.tokenizer
    if path is not None or tok is None or not getattr(tok, "chat_template", None):
        return tokenize(lm, text)
    parts = []
    for i, paragraph in enumerate(p for p in text.split("\n") if p.strip()):
        if i % 2:
            parts.append(torch.tensor(tok.apply_chat_template([{"role": "user", "content": paragraph}],
                                                              add_generation_prompt=True, tokenize=True,
                                                              return_dict=True)["input_ids"], dtype=torch.int64))
        else:
            parts.append(tokenize(lm, paragraph + "\n"))
    return torch.cat(parts)



def prepare_text(out: Path, wheel: Path | None = None) -> dict:
    """Write ``calib.txt`` and ``eval.txt`` into ``out`` (each atomically) from the gensim wheel,
    fetched by pip when ``wheel`` is not given. Returns what was written."""
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="llmnpu-gensim-") as tmp:
        if wheel is None:
            wheel = _download_wheel(Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as whl:
                lee = whl.read(LEE).decode("utf-8", errors="replace")
                wiki = wiki_paragraphs(whl.read(WIKI))
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            raise LlmNpuError(f"cannot read the default text from {wheel} ({type(e).__name__}): "
                              f"give the {GENSIM} wheel (pip download --no-deps {GENSIM})") from None
    calib = [re.sub(r"\s+", " ", ln).strip() for ln in lee.splitlines() if ln.strip()]
    for role, paragraphs in (("calib", calib), ("eval", wiki)):
        with atomic_path(out / ROLES[role]) as tmp:
            tmp.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return {"folder": str(out), "calib_documents": len(calib), "calib_words": sum(len(c.split()) for c in calib),
            "eval_paragraphs": len(wiki), "eval_words": sum(len(p.split()) for p in wiki)}


def _download_wheel(folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", GENSIM,
           "-d", str(folder)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob("gensim-4.4.0-*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel found"])[-1]
        raise LlmNpuError(f"the default text comes from the {GENSIM} wheel and pip could not fetch it ({last[:160]}): "
                          f"connect to the package index once, run `llmnpu prepare-text --wheel FILE` with a "
                          f"downloaded wheel, or pass a text file")
    return wheels[0]
