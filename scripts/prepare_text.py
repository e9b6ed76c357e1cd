"""Extract the default calibration and evaluation text from the gensim 4.4.0 wheel.

Calibration text: the Lee news corpus (lee_background.cor).
Evaluation text:  prose paragraphs of the shortened English Wikipedia dump.
Two different sources, so calibration never sees evaluation text.

Usage: python scripts/prepare_text.py --wheel gensim-4.4.0-....whl --out data
"""
from __future__ import annotations

import argparse
import bz2
import html
import io
import os
import re
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

WIKI = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE = "gensim/test/test_data/lee_background.cor"
MIN_WORDS = 20  # shorter lines are list items, captions and headings, not prose


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


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", required=True, help="path to gensim-4.4.0-*.whl")
    ap.add_argument("--out", default="data", help="output folder (default: data)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(args.wheel) as whl:
        lee = whl.read(LEE).decode("utf-8", errors="replace")
        wiki = wiki_paragraphs(whl.read(WIKI))
    calib = [re.sub(r"\s+", " ", ln).strip() for ln in lee.splitlines() if ln.strip()]
    write_atomic(out / "calib.txt", "\n\n".join(calib) + "\n")
    write_atomic(out / "eval.txt", "\n\n".join(wiki) + "\n")
    print(f"calibration: {len(calib)} news documents, {sum(len(c.split()) for c in calib)} words -> {out/'calib.txt'}")
    print(f"evaluation:  {len(wiki)} wikipedia paragraphs, {sum(len(p.split()) for p in wiki)} words -> {out/'eval.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
