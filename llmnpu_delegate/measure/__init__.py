"""Speed measured as users measure it: prefill and end-to-end against the baselines (``speed``), and conversation turns (``turns``)."""
