"""What a user waits for, from the times tokens arrived: one definition for every runner and benchmark."""
from __future__ import annotations


def decode_rate(tokens: int, decode_s: float) -> float | None:
    """Tokens a second after the first (the first token ends the prefill): None for a single token."""
    return (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None


def token_rates(start: float, times: list[float]) -> dict:
    """Time to first token and decode rate of a generation that started at ``start`` and produced a
    token at each of ``times`` (``time.perf_counter`` values)."""
    if not times:
        return {"ttft_s": None, "decode_tok_s": None}
    return {"ttft_s": times[0] - start, "decode_tok_s": decode_rate(len(times), times[-1] - times[0])}
