"""A prompt that continues a past (given, or found in the prefix cache) against the independent
reference, a full prefill of the whole prompt: within 1e-5 in fp32 mode, within a tenth of the
quantization effect in W8A8 mode; and the prefix cache's keys, budget and files."""
import logging

import pytest
import torch
from conftest import assert_within_quant_effect
from test_prefill import llama, llama_calib  # noqa: F401 - fixtures: tiny-llama with outliers, its calibration

from llmnpu_delegate.backends.graph_cache import GraphCache
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.hf import LlmNpuForCausalLM
from llmnpu_delegate.quantize import QuantConfig
from llmnpu_delegate.runtime.engine import Prefiller
from llmnpu_delegate.runtime.prefix_cache import PrefixCache, common_prefix

CHUNK = 8
QUANT = QuantConfig(pruning_rate=0.5)     # shadow paths on half the linears


@pytest.fixture(scope="module")
def engines(llama, llama_calib, tmp_path_factory):
    cache = GraphCache(tmp_path_factory.mktemp("graphs"))
    return {"fp32": Prefiller(llama, CHUNK, quant=None, cache=cache, progress=False, attention="fp32"),
            "w8a8": Prefiller(llama, CHUNK, quant=QUANT, calibration=llama_calib, cache=cache, progress=False,
                              attention="fp32")}


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed))


def _close(got, want, float_ref, mode: str):
    if mode == "fp32":
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    else:
        assert_within_quant_effect(got, want, float_ref)


# past lengths: mid-chunk (21 = 2 chunks + 5), on a chunk boundary (16), a single token (1)
@pytest.mark.parametrize("past_len", [21, 16, 1])
@pytest.mark.parametrize("mode", ["fp32", "w8a8"])
def test_a_continuation_equals_the_whole_prompt_prefilled(engines, mode, past_len):
    engine, ids = engines[mode], _prompt(45)
    whole, float_whole = engine(ids), engines["fp32"](ids)
    head = engine(ids[:past_len])
    rest = engine(ids[past_len:], past=(head.past_k, head.past_v))
    assert rest.reused == past_len and rest.tokens == 45
    assert rest.chunks == -(-(45 - past_len) // CHUNK)      # only the new tokens' chunks ran
    _close(rest.logits, whole.logits, float_whole.logits, mode)
    for got, want, flt in zip(rest.past_k + rest.past_v, whole.past_k + whole.past_v,
                              float_whole.past_k + float_whole.past_v):
        _close(got, want, flt, mode)
    # the given past comes back unchanged in front of the new tokens' K/V
    assert all(torch.equal(r[:, :, :past_len], h) for r, h in zip(rest.past_k, head.past_k))


@pytest.mark.parametrize("mode", ["fp32", "w8a8"])
def test_the_prefix_cache_serves_the_longest_shared_prefix(engines, mode):
    engine, ids = engines[mode], _prompt(60, seed=2)
    engine.prefix_cache = PrefixCache()
    try:
        first = engine(ids[:37])
        assert first.reused == 0
        longer = engine(ids)                             # starts with the cached 37 tokens
        same = engine(ids)                               # wholly cached: only its last token runs
        other = engine(torch.cat([ids[:30], _prompt(10, seed=3)]))    # shares 30 tokens
        assert (longer.reused, same.reused, other.reused) == (37, 59, 30)
        assert same.chunks == 1
    finally:
        engine.prefix_cache = None
    whole, float_whole = engine(ids), engines["fp32"](ids)
    assert whole.reused == 0
    for got in (longer, same):
        _close(got.logits, whole.logits, float_whole.logits, mode)
        for k, want, flt in zip(got.past_k, whole.past_k, float_whole.past_k):
            _close(k, want, flt, mode)


def test_an_entry_of_another_configuration_is_never_used(engines, llama, llama_calib):
    shared = PrefixCache()
    ids = _prompt(30, seed=4)
    others = [engines["w8a8"],
              Prefiller(llama, 16, quant=QUANT, calibration=llama_calib, progress=False, attention="fp32"),
              Prefiller(llama, CHUNK, quant=QuantConfig(pruning_rate=0.0), calibration=llama_calib, progress=False,
                        attention="fp32")]
    keys = {engines["fp32"].kv_key, *(e.kv_key for e in others)}
    assert len(keys) == 4
    try:
        engines["fp32"].prefix_cache = shared
        engines["fp32"](ids)
        for e in others:
            e.prefix_cache = shared
            assert e(ids).reused == 0          # same tokens, another model configuration
        assert engines["fp32"](ids).reused == 29
    finally:
        for e in [engines["fp32"], *others]:
            e.prefix_cache = None


def test_a_conversation_keeps_one_entry_and_the_budget_holds(engines):
    engine, ids = engines["fp32"], _prompt(64, seed=5)
    per_token = 2 * engine.kv.layers * engine.kv.kv_heads * engine.kv.head_dim * 4
    cache = engine.prefix_cache = PrefixCache(max_bytes=70 * per_token)
    try:
        for n in (20, 40, 64):                           # a growing conversation
            engine(ids[:n])
        assert len(cache) == 1 and cache.bytes == 64 * per_token
        engine(_prompt(10, seed=6))                      # does not fit beside it: the oldest goes
        assert len(cache) == 1 and cache.bytes == 10 * per_token and cache.stats.evicted == 1
        assert engine(ids).reused == 0
    finally:
        engine.prefix_cache = None


def test_entries_on_disk_serve_a_new_process_and_a_damaged_one_is_rebuilt(engines, tmp_path, caplog):
    engine, ids = engines["w8a8"], _prompt(40, seed=7)
    try:
        engine.prefix_cache = PrefixCache(max_bytes=0, directory=tmp_path)     # disk only
        want = engine(ids)
        engine.prefix_cache = PrefixCache(directory=tmp_path)                  # "a new process"
        again = engine(ids)
        assert again.reused == 39
        assert all(torch.equal(a, b) for a, b in zip(again.past_k, want.past_k))
        [kv] = tmp_path.glob("*/*.kv")
        kv.write_bytes(kv.read_bytes()[:-100])
        engine.prefix_cache = PrefixCache(directory=tmp_path)
        with caplog.at_level(logging.WARNING):
            rebuilt = engine(ids)
        assert rebuilt.reused == 0 and engine.prefix_cache.stats.damaged == 1
        assert "unusable" in caplog.text and "prefilled again" in caplog.text
        torch.testing.assert_close(rebuilt.logits, want.logits, atol=0, rtol=0)
        assert PrefixCache(directory=tmp_path).lookup(engine.kv_key, ids).tokens == 39    # written anew
        assert not [p for p in tmp_path.rglob(".*")], "a temporary file was left behind"
    finally:
        engine.prefix_cache = None


def test_bad_pasts_are_refused_in_one_line(engines, tmp_path):
    engine = engines["fp32"]
    head = engine(_prompt(10))
    with pytest.raises(LlmNpuError, match="past has K/V for 1/1 layers"):
        engine(_prompt(5), past=(head.past_k[:1], head.past_v[:1]))
    with pytest.raises(LlmNpuError, match="one P for every layer"):
        engine(_prompt(5), past=(head.past_k, [v[:, :, :3] for v in head.past_v]))
    with pytest.raises(LlmNpuError, match="after a past of 10, more than the context"):
        engine(torch.zeros(engine.context - 5, dtype=torch.long), past=(head.past_k, head.past_v))
    with pytest.raises(LlmNpuError, match="bytes >= 0"):
        PrefixCache(max_bytes=-1)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LlmNpuError, match="give a writable --kv-cache-dir"):
        PrefixCache(directory=blocker / "kv")


def test_common_prefix():
    a = torch.tensor([1, 2, 3, 4])
    assert common_prefix(a, torch.tensor([1, 2, 9])) == 2
    assert common_prefix(a, a[:2]) == 2 and common_prefix(a, torch.tensor([7])) == 0


# ---------------------------------------------------------------------- the Hugging Face door
@pytest.mark.parametrize("decode", ["fp32", "int8"])
def test_generate_continues_from_its_own_past_key_values(llama, llama_calib, decode):
    """Turn 2 from turn 1's returned cache prefills only its new tokens and gives the tokens of a
    full prefill of the whole history (fp32 mode: identical)."""
    wrapper = LlmNpuForCausalLM(llama, chunk_len=CHUNK, quant="fp32", decode=decode, prefix_cache=False,
                                progress=False)
    turn1 = _prompt(21, seed=8)[None]
    out = wrapper.generate(turn1, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    history = torch.cat([out.sequences, _prompt(11, seed=9)[None]], dim=1)
    cont = wrapper.generate(history, past_key_values=out.past_key_values, max_new_tokens=6, do_sample=False)
    assert wrapper.last_prefill["cached_tokens"] == out.sequences.shape[1] - 1   # its last token was never fed
    full = wrapper.generate(history, max_new_tokens=6, do_sample=False)
    assert wrapper.last_prefill["cached_tokens"] == 0
    assert cont.tolist() == full.tolist()
    if decode == "fp32":
        assert full.tolist() == llama.model.generate(history, max_new_tokens=6, do_sample=False).tolist()


def test_generate_reuses_a_history_sent_again(llama, llama_calib):
    wrapper = LlmNpuForCausalLM(llama, chunk_len=CHUNK, calibration=llama_calib, pruning_rate=0.5, decode="int8",
                                progress=False)
    turn1 = _prompt(30, seed=10)[None]
    out = wrapper.generate(turn1, max_new_tokens=4, do_sample=False)
    history = torch.cat([out, _prompt(9, seed=11)[None]], dim=1)
    again = wrapper.generate(history, max_new_tokens=6, do_sample=False)
    assert wrapper.last_prefill["cached_tokens"] == 30 and wrapper.last_prefill["tokens"] == history.shape[1]
    wrapper.engine.prefix_cache = None
    assert wrapper.generate(history, max_new_tokens=6, do_sample=False).tolist() == again.tolist()
