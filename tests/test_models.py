"""Model registry: specs, families, and clear errors on bad input."""
import json

import pytest
import torch

from llmnpu_delegate import LlmNpuError
from llmnpu_delegate.models import RANDOM_SHAPES, SUPPORTED_FAMILIES, load_model


def test_random_models_are_deterministic_and_cover_all_families():
    families = set()
    for shape in RANDOM_SHAPES:
        if shape.startswith("tiny-"):
            a, b = load_model(f"random:{shape}"), load_model(f"random:{shape}")
            assert a.fingerprint == b.fingerprint
            families.add(a.family)
    assert families == set(SUPPORTED_FAMILIES)


def test_real_shapes_match_published_configs():
    from llmnpu_delegate.models import RANDOM_SHAPES
    q = RANDOM_SHAPES["qwen2-0.5b"][1]
    assert (q["hidden_size"], q["intermediate_size"], q["num_hidden_layers"], q["vocab_size"]) == (896, 4864, 24, 151936)
    l = RANDOM_SHAPES["llama-1b"][1]
    assert (l["hidden_size"], l["intermediate_size"], l["num_hidden_layers"], l["num_key_value_heads"]) == (2048, 8192, 16, 8)


def test_hf_folder_roundtrip(tmp_path):
    lm = load_model("random:tiny-qwen2")
    lm.model.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    x = torch.randint(0, 500, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(again.model(input_ids=x).logits, lm.model(input_ids=x).logits)
    assert again.fingerprint == lm.fingerprint


def test_unknown_spec():
    with pytest.raises(LlmNpuError, match="unknown model 'gpt-17'.*smollm2-135m"):
        load_model("gpt-17")
    with pytest.raises(LlmNpuError, match="unknown random shape 'huge'"):
        load_model("random:huge")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(LlmNpuError, match="unsupported architecture 'gpt2'.*llama, qwen2"):
        load_model(str(tmp_path))


def test_folder_without_config(tmp_path):
    with pytest.raises(LlmNpuError, match="no config.json"):
        load_model(str(tmp_path))


def test_missing_and_corrupt_gguf(tmp_path):
    with pytest.raises(LlmNpuError, match="GGUF file not found"):
        load_model(str(tmp_path / "none.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(LlmNpuError, match="corrupt"):
        load_model(str(bad))


def test_no_progress_hides_the_gguf_readers_bar(monkeypatch, tmp_path, capsys):
    """transformers' GGUF reader calls tqdm itself, past transformers' own switch for its bars: a
    loading whose reader shows a bar (a stand-in for the dequantizing one) prints it, and prints
    nothing after ``--no-progress``'s ``hide_progress_bars``."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging

    from llmnpu_delegate import models
    from llmnpu_delegate.logs import hide_progress_bars

    def reading(*args, **kwargs):
        list(reader.tqdm(range(3), desc="dequantizing"))
        return torch.nn.Linear(1, 1)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(models, "check_family", lambda config: None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", reading)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    hf_logging.enable_progress_bar()
    models._load_gguf(gguf)
    assert "dequantizing" in capsys.readouterr().err     # the bar the reader shows by default
    hide_progress_bars()
    try:
        models._load_gguf(gguf)
        assert "dequantizing" not in capsys.readouterr().err
    finally:
        hf_logging.enable_progress_bar()
