"""Model families: what each supported architecture looks like to the engine, in one declaration.

A family names its ``transformers`` ``model_type``, the linears of a decoder block by role (the
attention's input projections, its output, the MLP's input and output projections), its two block
norms and what else its attention does (per-head q/k norms before RoPE), and which of the project's
paths run it. Loading (``models``), the INT8 decoder (``runtime/hf_decoder.py``), the phone simulator's
roles (``simulate/phone.py``) and the tests read it from here; capture, the partitioner and export
read the model's own modules, so they need nothing per family.

Adding a family is one ``Family(...)`` below and its tests (``tests/test_families.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import LlmNpuError


@dataclass(frozen=True)
class Family:
    model_type: str                                   # transformers' ``config.model_type``
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    o: str = "self_attn.o_proj"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")
    qk_norm: tuple[str, str] | None = None            # per-head RMSNorm of q and k before RoPE
    engine: bool = True                               # prefill, export and the runners run it
    int8_decode: bool = True                          # ``runtime/hf_decoder.Int8Decoder`` runs it
    # ``random:<name>`` shapes: config kwargs; ``tiny-*`` ones serve the tests, the others are the
    # published configs of real models (speed work and ``llmnpu simulate``)
    shapes: dict = field(default_factory=dict, compare=False)

    @property
    def linears(self) -> tuple[str, ...]:
        """Every linear of a block (names relative to the block), in the order the block uses them."""
        return (*self.qkv, self.o, *self.gate_up, self.down)

    def reads_a_norm(self, name: str) -> bool:
        """Whether a linear of this family (full or block-relative name) reads a block norm's output:
        q/k/v and gate/up. The partitioner finds the same linears in a traced graph
        (``partitioner.regions.reads_a_norm``); a test keeps the two in step for every family."""
        return self.role(name) in ("qkv", "up")

    def role(self, name: str) -> str | None:
        """``qkv``, ``o``, ``up`` or ``down`` for a linear of this family (a full or block-relative name)."""
        for role, names in (("qkv", self.qkv), ("o", (self.o,)), ("up", self.gate_up), ("down", (self.down,))):
            if any(name == n or name.endswith("." + n) for n in names):
                return role
        return None


# The tests' shapes: two blocks, four heads, the real vocabulary (the embedded model's tokenizer fits)
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", shapes={
        "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
        # Llama-3.2-3B and Llama-3.1-8B (the phone model's validation rows)
        "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
        "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500_000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
        # SmolLM2-1.7B and Falcon3-7B are Llama-architecture models
        "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                             num_key_value_heads=32, vocab_size=49152, max_position_embeddings=8192,
                             rope_theta=130_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
        "falcon3-7b": dict(hidden_size=3072, intermediate_size=23040, num_hidden_layers=28, num_attention_heads=12,
                           num_key_value_heads=4, head_dim=256, vocab_size=131072, max_position_embeddings=32768,
                           rope_theta=1000042.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
        "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
        "tiny-llama": dict(_TINY)}),
    Family("qwen2", shapes={
        "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                           num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                           rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
        "qwen1.5-1.8b": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16,
                             num_key_value_heads=16, vocab_size=151936, max_position_embeddings=32768,
                             rope_theta=1_000_000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
        "tiny-qwen2": dict(_TINY)}),
    Family("mistral", shapes={
        "mistral-7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
                           rope_theta=10_000.0, sliding_window=None, rms_norm_eps=1e-5),
        "tiny-mistral": dict(_TINY, sliding_window=None)}),
    # Qwen3: per-head RMSNorm of q and k before RoPE, and a head_dim of its own (128 where
    # hidden / heads is 64 for 0.6B): the tiny shape keeps that mismatch too
    Family("qwen3", qk_norm=("self_attn.q_norm", "self_attn.k_norm"), shapes={
        "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                           rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
        "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                           rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
        "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                         rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
        "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                         rope_theta=1_000_000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
        "tiny-qwen3": dict(_TINY, head_dim=32)}),
    # gemma's norms scale by (1 + w), gemma2/3 add norms after attention and MLP and soft-capping:
    # the prefill runs their own modules; the INT8 decoder's fixed block does not
    Family("gemma", int8_decode=False, shapes={
        "gemma-2b": dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
                         num_key_value_heads=1, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                         rms_norm_eps=1e-6),
        "tiny-gemma": dict(_TINY, head_dim=16)}),
    Family("gemma2", int8_decode=False, shapes={"tiny-gemma2": dict(_TINY, head_dim=16, sliding_window=64)}),
    Family("gemma3_text", qk_norm=("self_attn.q_norm", "self_attn.k_norm"), int8_decode=False, shapes={"tiny-gemma3": dict(_TINY, head_dim=16, sliding_window=64)}),
    # phi3 fuses q/k/v and gate/up into one linear each
    Family("phi3", qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",), int8_decode=False,
           shapes={"tiny-phi3": dict(_TINY, pad_token_id=0)}),
    # phi-2 (a model of the paper) is simulated from its shapes only: LayerNorm, parallel attention and MLP
    Family("phi", o="self_attn.dense", gate_up=("mlp.fc1",), down="mlp.fc2", engine=False, int8_decode=False,
           shapes={"phi-2": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=51200,
                                 max_position_embeddings=2048, partial_rotary_factor=0.4, layer_norm_eps=1e-5)}),
)}
ENGINE_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.engine)
# ``random:<shape>`` -> (model_type, config kwargs)
SHAPES: dict[str, tuple[str, dict]] = {name: (f.model_type, kw) for f in FAMILIES.values() for name, kw in f.shapes.items()}


def tiny_shapes(engine: bool = True, int8_decode: bool = False) -> list[str]:
    """``random:`` names of the tests' tiny shapes, one per family (those the engine / INT8 decode run)."""
    return [name for f in FAMILIES.values() if (f.engine or not engine) and (f.int8_decode or not int8_decode)
            for name in f.shapes if name.startswith("tiny-")]


def role_of(name: str) -> str | None:
    """A linear's role in its block (``Family.role``) whatever its family, from its full name (a
    weight's name too)."""
    name = name.removesuffix(".weight")
    return next((r for f in FAMILIES.values() if (r := f.role(name))), None)


# the roles whose outputs the residual stream adds: their output error reaches every later block
RESIDUAL_ROLES = ("o", "down")


def writes_residual(name: str) -> bool:
    """Whether the linear ``name`` (full or weight name, any family) writes the residual stream."""
    return role_of(name) in RESIDUAL_ROLES


def family_of(config) -> Family:
    """The family of a ``transformers`` config, or an LlmNpuError naming the supported ones."""
    family = FAMILIES.get(config.model_type)
    if family is None or not family.engine:
        raise LlmNpuError(f"unsupported architecture '{config.model_type}': supported decoder-only families are "
                          f"{', '.join(ENGINE_FAMILIES)}")
    return family
