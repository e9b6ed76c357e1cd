"""``llmnpu calibrate``."""
from __future__ import annotations

from ..quantize import load_or_calibrate
from ..quantize.importance import ratio_importance
from ..text import calibration_ids
from .common import add_model_args, setup


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="record activation statistics of every decoder linear and save them",
                       description="Run the float model over calibration text; save the versioned artefact.")
    add_model_args(p)
    p.add_argument("--out", default=None, help="artefact path (default: in the cache, keyed by model and text)")
    p.add_argument("--clip-percentile", type=float, default=99.5, help="percentile shown in the summary")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> dict:
    lm, calib_config = setup(args)
    ids = calibration_ids(lm, args.calib_text_file)
    calib = load_or_calibrate(lm.model, ids, lm.fingerprint, calib_config, path=args.out,
                              progress=not args.no_progress)
    p = args.clip_percentile
    calib.threshold(next(iter(calib.layers)), p)  # a clear error if p was not calibrated
    ratio = ratio_importance(calib, p)  # the paper's importance: largest outlier / scale
    layers = {n: {"absmax": round(s.absmax, 4), f"p{p}": round(s.percentiles[p], 4),
                  "outlier_fraction": round(s.outlier_fraction(p), 5),
                  "max_over_scale": round(ratio[n], 1)}
              for n, s in calib.layers.items()}
    return {"model": lm.spec, "fingerprint": lm.fingerprint, "artefact": str(calib.path),
            "calibration": calib.config.to_dict(), "layers": layers}
