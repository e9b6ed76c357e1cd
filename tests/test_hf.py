"""The Hugging Face door: generate() with the NPU prefill against transformers' own generate()."""
import pytest
import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.families import tiny_shapes
from llmnpu_delegate.hf import LlmNpuForCausalLM
from llmnpu_delegate.models import load_model
from llmnpu_delegate.quantize import quant_config

FAMILIES = [f"random:{shape}" for shape in tiny_shapes()]     # one per declared family (families.py)


@pytest.fixture(scope="module")
def llama():
    lm = load_model("random:tiny-llama")
    return lm, LlmNpuForCausalLM(lm, quant="fp32", chunk_len=16, progress=False)


@pytest.mark.parametrize("spec", FAMILIES)
def test_float_greedy_equals_hf_token_for_token(spec):
    lm = load_model(spec)
    wrapper = LlmNpuForCausalLM(lm, quant="fp32", chunk_len=32, progress=False)
    # 150 tokens: several chunks, and more than two sliding windows (64) for gemma2/gemma3
    ids = torch.randint(0, lm.model.config.vocab_size, (1, 150))
    ref = lm.model.generate(ids, max_new_tokens=16, do_sample=False)
    out = wrapper.generate(ids, max_new_tokens=16, do_sample=False)
    assert out.tolist() == ref.tolist()
    assert wrapper.last_prefill["chunks"] == 5 and wrapper.last_prefill["tokens"] == 150


def test_prefill_goes_through_the_engine(llama):
    lm, wrapper = llama
    ids = torch.randint(0, 1000, (1, 40))
    runs = []
    original = wrapper.engine.__class__.__call__

    def spy(self, *a, **k):
        runs.append(1)
        return original(self, *a, **k)

    wrapper.engine.__class__.__call__ = spy
    try:
        wrapper.generate(ids, max_new_tokens=3, do_sample=False)
    finally:
        wrapper.engine.__class__.__call__ = original
    assert runs == [1]
    assert "_prefill" not in vars(lm.model)   # the hook is gone after generate


def test_sampling_matches_hf_with_the_same_seed(llama):
    lm, wrapper = llama
    ids = torch.randint(0, 1000, (1, 33))
    kw = dict(max_new_tokens=12, do_sample=True, temperature=0.7, top_p=0.9)
    torch.manual_seed(3)
    ref = lm.model.generate(ids, **kw)
    torch.manual_seed(3)
    out = wrapper.generate(ids, **kw)
    assert out.tolist() == ref.tolist()


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.chunks.append("end")


def test_streamer_and_eos(llama):
    lm, wrapper = llama
    ids = torch.randint(0, 1000, (1, 20))
    full = wrapper.generate(ids, max_new_tokens=8, do_sample=False)[0, 20:].tolist()
    streamer = Collect()
    out = wrapper.generate(ids, max_new_tokens=8, do_sample=False, streamer=streamer)
    assert streamer.chunks[0] == ids[0].tolist() and streamer.chunks[-1] == "end"
    assert sum(streamer.chunks[1:-1], []) == out[0, 20:].tolist() == full
    # stopping at an eos token: the third generated token
    eos = full[2]
    stop = full.index(eos) + 1
    out = wrapper.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert out[0, 20:].tolist() == full[:stop]


def test_unsupported_inputs_are_refused_clearly(llama):
    lm, wrapper = llama
    ids = torch.randint(0, 1000, (2, 10))
    with pytest.raises(LlmNpuError, match="batch 1"):
        wrapper.generate(ids, max_new_tokens=2)
    one = ids[:1]
    mask = torch.ones_like(one)
    mask[0, :3] = 0
    with pytest.raises(LlmNpuError, match="padding"):
        wrapper.generate(one, attention_mask=mask, max_new_tokens=2)
    with pytest.raises(LlmNpuError, match="use_cache"):
        wrapper.generate(one, max_new_tokens=2, use_cache=False)
    assert "_prefill" not in vars(lm.model)
    with pytest.raises(LlmNpuError, match="shadow"):
        quant_config("w8a8", pruning_rate=0.5)
    with pytest.raises(LlmNpuError, match="causal LM"):
        LlmNpuForCausalLM(torch.nn.Linear(2, 2))
    assert quant_config("w8a8-shadow", pruning_rate=0.5).pruning_rate == 0.5


def test_quantized_prefill_hands_its_own_kv_to_the_decoder():
    """W8A8+shadow: generate's first token and the (float) decode steps use the engine's logits and K/V."""
    from conftest import outlier_model

    lm = outlier_model()
    from llmnpu_delegate.quantize import CalibConfig, calibrate

    calib = calibrate(lm.model, torch.randint(0, 1000, (2048,)), lm.fingerprint, CalibConfig(samples=4, tokens=128,
                                                                                             probe_tokens=128))
    wrapper = LlmNpuForCausalLM(lm, chunk_len=16, calibration=calib, pruning_rate=0.5, decode="fp32", progress=False)
    ids = torch.randint(0, 1000, (1, 50))
    out = wrapper.generate(ids, max_new_tokens=6, do_sample=False)[0, 50:]
    # reference: the engine's prefill, then the float model decoding from that cache by hand
    res = wrapper.engine(ids)
    cache = DynamicCache(config=lm.model.config)
    for layer, (k, v) in enumerate(zip(res.past_k, res.past_v)):
        cache.update(k, v, layer)
    tokens = [int(res.logits.argmax())]
    with torch.no_grad():
        for _ in range(5):
            logits = lm.model(torch.tensor([[tokens[-1]]]), past_key_values=cache).logits
            tokens.append(int(logits[0, -1].argmax()))
    assert out.tolist() == tokens
    assert 0 < wrapper.last_prefill["outlier_share"] < 0.2
    # and the wrapper's INT8 prefill is integer arithmetic: a wrapper on int64 linears agrees
    from conftest import on_int64
    reference = on_int64(LlmNpuForCausalLM, lm, chunk_len=16, calibration=calib, pruning_rate=0.5, decode="fp32",
                         progress=False)
    want = on_int64(reference.engine, ids).logits
    with torch.no_grad():
        effect = float((want - lm.model(ids).logits[0, -1]).abs().max())
    assert effect > 1e-3 and float((res.logits - want).abs().max()) <= effect / 1000


def test_run_command_and_its_errors(tmp_path, capsys):
    import json

    from llmnpu_delegate.cli import main

    assert main(["run", "--model", "random:tiny-llama", "--prompt", "hello there", "--quant", "fp32", "--chunk", "8",
                 "--max-new-tokens", "3", "--json", "--no-progress", "--trace", str(tmp_path / "tr")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["new_tokens"] == 3 and summary["chunks"] == 1 and summary["policy"] == "ooo"
    assert (tmp_path / "tr" / "prefill.trace.json").is_file() and (tmp_path / "tr" / "prefill.png").is_file()
    assert main(["run", "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", "--prompt", "hi", "--temperature", "0"]) == 2
    assert "--temperature must be positive" in capsys.readouterr().err


def test_two_wrappers_over_one_model_generate_from_two_threads():
    """Each thread's generate must use its own wrapper's engine (one fp32, one W8A8: their first
    logits differ), while HF's own generate runs beside them untouched; the model is left as found."""
    import gc
    import threading

    from conftest import outlier_model

    lm = outlier_model()
    wrappers = {"fp32": LlmNpuForCausalLM(lm, quant="fp32", chunk_len=16, progress=False),
                "w8a8": LlmNpuForCausalLM(lm, quant="w8a8-shadow", chunk_len=16, progress=False),
                "hf": lm.model}
    prompts = [torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(n)) for n in (21, 40, 9)]
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)

    def first_logits(name, ids):
        return wrappers[name].generate(ids, **kw).logits[0][0]

    want = {(name, i): first_logits(name, ids) for name in wrappers for i, ids in enumerate(prompts)}
    assert not torch.equal(want["fp32", 0], want["w8a8", 0])
    threads_before, gc_before = torch.get_num_threads(), gc.isenabled()
    got, errors = {}, []

    def client(name):
        try:
            for _ in range(3):
                for i, ids in enumerate(prompts):
                    got.setdefault((name, i), []).append(first_logits(name, ids))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(name,)) for name in wrappers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for key, runs in got.items():
        assert len(runs) == 3, key
        for r in runs:
            if key[0] == "hf":   # torch's thread count is process-wide: a run beside a prefill may sum in another order
                torch.testing.assert_close(r, want[key], rtol=1e-5, atol=1e-5)
            else:                # the engines' prefill runs one prompt at a time, single-threaded per worker
                assert torch.equal(r, want[key]), key
    assert "_prefill" not in vars(lm.model)
    assert torch.get_num_threads() == threads_before and gc.isenabled() == gc_before
