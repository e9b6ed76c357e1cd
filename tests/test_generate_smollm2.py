"""The HF wrapper on the embedded model (slow): float is HF token for token; W8A8 + shadow agrees."""
import pytest

from llmnpu_delegate.hf import LlmNpuForCausalLM, greedy_agreement
from llmnpu_delegate.text import CHAT_QUESTIONS

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain photosynthesis in one sentence.", "Give me a tip for learning Python."]


def _chat(tok, question):
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]


def test_float_generate_equals_hf_on_the_embedded_model(smollm2):
    wrapper = LlmNpuForCausalLM(smollm2, quant="fp32", chunk_len=32, progress=False)
    ids = _chat(smollm2.tokenizer, QUESTIONS[0])      # 37 tokens: two chunks
    ref = smollm2.model.generate(ids, max_new_tokens=20, do_sample=False)
    out = wrapper.generate(ids, max_new_tokens=20, do_sample=False)
    assert out.tolist() == ref.tolist()
    assert "Paris" in smollm2.tokenizer.decode(out[0, ids.shape[1]:])


def test_shadow_generate_agrees_with_float(smollm2):
    """W8A8 + shadow with every shadow path kept (a fixed plan: the automatic pruning is chosen by
    timing this machine's engine; calibration on the shipped news text with chat samples) and INT8
    decode, on the six CHAT_QUESTIONS (benchmarks/greedy_agreement.py's)."""
    wrapper = LlmNpuForCausalLM(smollm2, pruning_rate=0.0, progress=False)
    prompts = [_chat(smollm2.tokenizer, q) for q in CHAT_QUESTIONS]
    agreement = greedy_agreement(wrapper, prompts, max_new_tokens=64)
    print("greedy agreement with float:", agreement)
    # measured 0.904 here with bf16 attention in the prefill, 0.936 with fp32 (0.915 at 24 tokens;
    # naive W8A8 at the absolute-maximum scale: 0.70 at 24)
    assert agreement["teacher_forced"] >= 0.75
    # INT8 decode against float decode, from the same prefill and fed the same tokens (the issue's
    # gate). 64 tokens a prompt, not 24, so that one step is not a third of the margin: measured
    # 0.981 with the native step after a prefill with bf16 attention; with fp32 attention 0.976 (0.972
    # with the Python loop, 0.976 with every linear in bf16; at 24 tokens 0.973 / 0.973 / 0.982 over
    # 111 steps). Without the per-token outlier rows: 0.94.
    # The measure moves by a step or two with the CPU (the prefill's oneDNN kernels differ): with the
    # exact 8-bit native decode 0.962 on an AMX-class Xeon (fbgemm's 8-bit there: 0.967; 7-bit
    # activations as AVX2-only: 0.962). A saturating decode measured 0.929; no outlier rows, 0.94.
    assert agreement["decode_teacher_forced"] >= 0.95
    # naive W8A8's prefill agrees less (0.70 at 24 tokens): its float decode and 24 tokens suffice
    naive = LlmNpuForCausalLM(smollm2, quant="w8a8", decode="fp32", progress=False)
    assert greedy_agreement(naive, prompts, max_new_tokens=24)["teacher_forced"] < agreement["teacher_forced"]


def test_run_command_summary(capsys):
    import json

    from llmnpu_delegate.cli import main

    # the placement fixed: an automatic one is chosen by timing this machine's engine (its own tests
    # inject the timing: test_placement.py)
    assert main(["run", "--prompt", QUESTIONS[0], "--chat", "--max-new-tokens", "8", "--no-progress",
                 "--json", "--placement", "paper"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prompt_tokens"] == 37 and summary["chunks"] == 1 and 1 <= summary["new_tokens"] <= 8
    assert summary["policy"] == "ooo" and summary["quant"] == "w8a8-shadow" and summary["placement"] == "paper"
    assert summary["prefill_tok_s"] > 0 and summary["ttft_s"] >= summary["prefill_s"]
    assert 0 < summary["outlier_share"] < 0.05
