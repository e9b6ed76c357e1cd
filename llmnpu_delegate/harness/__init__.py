"""The lm-evaluation-harness door: our model for ``lm_eval`` (``lm.py``) and offline tasks (``tasks.py``).

Needs the ``eval`` extra (``pip install -e '.[eval]'``, lm-eval from PyPI); ``llmnpu-lm-eval`` is
``lm_eval`` with the ``llmnpu`` model registered and the offline tasks on its include path.
"""
from __future__ import annotations

import sys

from ..errors import LlmNpuError
from ..logs import quiet_third_party_logs


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise LlmNpuError("lm-eval is not installed: pip install -e '.[eval]' (lm-eval==0.4.13)") from None


def main() -> None:
    """``llmnpu-lm-eval``: lm_eval's own command line, with ``--model llmnpu`` and the offline tasks."""
    quiet_third_party_logs()    # a user's first screen of this door is lm_eval's own
    require_lm_eval()
    from lm_eval.__main__ import cli_evaluate

    from . import lm  # noqa: F401  (registers the "llmnpu" model)
    from .offline_tasks import task_dir

    args = sys.argv[1:]
    if "--include_path" not in args and not any(a.startswith("--include_path=") for a in args) \
            and ("--tasks" in args or any(a.startswith("--tasks=") for a in args)):
        sys.argv[1:] = [*args, "--include_path", str(task_dir())]
    cli_evaluate()
