"""``llmnpu prepare-text``."""
from __future__ import annotations

from pathlib import Path

from ..text import prepare_text, text_dir
from .common import add_output_args


def add_parser(sub) -> None:
    p = sub.add_parser("prepare-text", help="extract the default calibration and evaluation text (first use does it too)",
                       description="Write calib.txt (the Lee news corpus) and eval.txt (English Wikipedia prose) from "
                                   "the gensim 4.4.0 wheel, fetched by pip unless --wheel is given, into the text "
                                   "folder (LLMNPU_DATA_DIR, else text/ in the cache folder).")
    p.add_argument("--wheel", default=None, help="a downloaded gensim-4.4.0 wheel (default: pip download it)")
    p.add_argument("--out", default=None, help="output folder (default: the text folder)")
    add_output_args(p)
    p.set_defaults(func=cmd_prepare_text)


def cmd_prepare_text(args) -> dict:
    result = prepare_text(Path(args.out) if args.out else text_dir(), Path(args.wheel) if args.wheel else None)
    if not args.json:
        args.text = (f"calibration: {result['calib_documents']} news documents, {result['calib_words']} words\n"
                     f"evaluation:  {result['eval_paragraphs']} Wikipedia paragraphs, {result['eval_words']} words\n"
                     f"-> {result['folder']}")
    return result
