"""ExecuTorch's Qualcomm quantization as a scored peer (``recipes.py``): its encodings are the
recipe's, the scorer is quantized by what the recipe says, and every door scores it alike."""
import json

import pytest
import torch
from conftest import missing

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.models import load_model
from llmnpu_delegate.qnn import sdk as qsdk
from llmnpu_delegate.quantize import CalibConfig
from llmnpu_delegate.quantize.calibrate import calibration_samples
from llmnpu_delegate.quantize.sqnr import sqnr_db
from llmnpu_delegate.recipes import hadamard, recipe_graph, recipe_model, rotary_nodes
from llmnpu_delegate.text import calibration_ids

pytestmark = pytest.mark.skipif(qsdk.importlib.util.find_spec("onnxruntime_qnn") is None,
                                reason=missing("the qnn extra (pip install -e '.[qnn]')"))


@pytest.fixture(scope="module")
def lm():
    return load_model("random:tiny-llama")


@pytest.fixture(scope="module")
def scorers(lm):
    samples = calibration_samples(calibration_ids(lm), CalibConfig(samples=4, tokens=64))
    return {mode: recipe_model(lm, mode, samples, progress=False) for mode in ("et-16a8w", "et-16a4w", "et-8a8w")}


def _encodings(scorer) -> dict:
    """The scorer's encodings as (quant_min, quant_max): activations (its fake-quant nodes, one per
    quantize node of the converted graph), weights (the per-channel dequantize nodes of its constants)."""
    acts, weights = set(), set()
    for node in scorer.graph.graph.nodes:
        name = str(node.target)
        if getattr(node.target, "__name__", "") == "_fake_quant":
            acts.add(tuple(node.args[3:5]))
        elif "dequantize_per_channel" in name and node.args[0].op == "get_attr":
            weights.add(tuple(node.args[4:6]))
    return {"acts": acts, "weights": weights}


def test_the_graph_carries_the_recipes_encodings(scorers):
    """Activations unsigned 16-bit in the 16-bit recipes (a matmul's second operand signed symmetric,
    as HTP takes it), unsigned 8-bit in 8a8w; weights per output channel, symmetric, 8-bit or 4-bit."""
    seen = {mode: _encodings(s) for mode, s in scorers.items()}
    for mode in ("et-16a8w", "et-16a4w"):
        assert (0, 65535) in seen[mode]["acts"] and seen[mode]["acts"] <= {(0, 65535), (-32767, 32767)}, seen
    assert seen["et-8a8w"]["acts"] == {(0, 255)}, seen
    assert seen["et-16a8w"]["weights"] == seen["et-8a8w"]["weights"] == {(-127, 127)}, seen
    assert seen["et-16a4w"]["weights"] == {(-7, 7)}, seen


def test_q_and_k_are_rotated_by_r3_as_the_recipes_model_does(lm, scorers):
    """SpinQuant's R3, as ExecuTorch's static llama applies it for this recipe: Q and K times an
    orthonormal Hadamard matrix after RoPE. In float the rotation leaves the logits unchanged (Q·Kᵀ is
    invariant); in every recipe's graph each of the 2 x layers rotations is quantized on its own, at
    the recipe's activation precision."""
    h = hadamard(8)
    assert torch.equal(h.abs(), torch.full((8, 8), 8 ** -0.5)) and torch.allclose(h @ h.T, torch.eye(8), atol=1e-6)
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = lm.model(input_ids=ids, use_cache=False).logits
        rotated = recipe_graph(lm, ids[:, :8], r3=True)(ids)
    assert (rotated - want).abs().max() < 1e-5
    layers = lm.model.config.num_hidden_layers
    for mode, scorer in scorers.items():
        rotations = [n for n in scorer.graph.graph.nodes if "hadamard" in str(n.target)]
        assert len(rotations) == 2 * layers, (mode, len(rotations))
        bits = {tuple(u.args[3:5]) for n in rotations for u in n.users}
        assert bits == ({(0, 255)} if mode == "et-8a8w" else {(0, 65535)}), (mode, bits)
    with pytest.raises(LlmNpuError, match="power-of-two size, not 48"):
        hadamard(48)


def test_rotary_angles_stay_float_and_cos_sin_are_quantized_where_attention_reads_them(scorers):
    """ExecuTorch's static llama looks cos and sin up in float tables. An encoding of the angles
    (position times frequency) would be observed up to the calibration windows' last position and
    clip every later one: on the embedded model, perplexity 75.6 and 0.4 dB at windows of 1,024 after
    calibration at 512. Every encoding of the rotary embedding's outputs is cos and sin's [-1, 1]."""
    for mode, scorer in scorers.items():
        graph = scorer.graph
        rotary = set(rotary_nodes(graph))
        ranges = [(node.args[1] * (node.args[3] - node.args[2]), node.args[1] * (node.args[4] - node.args[2]))
                  for node in graph.graph.nodes
                  if getattr(node.target, "__name__", "") == "_fake_quant" and node.args[0].name in rotary]
        assert len(ranges) == 2, (mode, ranges)                  # cos and sin, once each
        assert all(-1.01 < lo and hi < 1.01 for lo, hi in ranges), (mode, ranges)


def test_masked_scores_get_executorchs_additive_mask(lm, scorers):
    """ExecuTorch's static llama adds -255 to a masked score. With the dtype's minimum instead, the
    softmax input's encoding spans ~65,550 and steps by 1.0 at 16 bits (the embedded model's 16a8w
    recipe: perplexity 24.00 and logits 18.7 dB from fp32, against 23.29 and 23.9 with -255). The
    encoding's low end is -255 plus the lowest masked score, with or without R3; in float the mask
    changes nothing."""
    samples = calibration_samples(calibration_ids(lm), CalibConfig(samples=4, tokens=64))
    graphs = dict(scorers, no_r3=recipe_model(lm, "et-16a8w", samples, progress=False, r3=False))
    for mode, scorer in graphs.items():
        inputs = [n.args[0] for n in scorer.graph.graph.nodes if "softmax" in str(n.target)]
        assert len(inputs) == lm.model.config.num_hidden_layers, mode
        for fq in inputs:
            scale, zero_point = fq.args[1:3]
            assert -260 < -zero_point * scale < -255, (mode, scale, zero_point)
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(recipe_graph(lm, ids[:, :8], r3=False)(ids), lm.model(input_ids=ids, use_cache=False).logits)


def test_the_scorer_computes_the_converted_graph_bit_for_bit(lm, scorers, monkeypatch):
    """The scorer folds the converted graph's quantize/dequantize pairs of activations into one
    fake-quant each: the same numbers as ExecuTorch's converted graph, run as convert_pt2e wrote it,
    to the bit, and none of those decomposed pairs left."""
    from llmnpu_delegate import recipes

    monkeypatch.setattr(recipes, "_fold_fake_quant", lambda graph: graph)
    samples = calibration_samples(calibration_ids(lm), CalibConfig(samples=4, tokens=64))
    converted = recipe_model(lm, "et-16a8w", samples, progress=False)
    ids = torch.randint(0, 1000, (1, 70), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(scorers["et-16a8w"](ids).logits, converted(ids).logits)
    def quantizes(graph):
        return [n for n in graph.graph.nodes if str(n.target).endswith(".quantize_per_tensor.default")]

    left = [n for n in scorers["et-16a8w"].graph.graph.nodes if "dequantize" in str(n.target)]
    assert quantizes(converted.graph) and not quantizes(scorers["et-16a8w"].graph)
    assert all(n.args[0].op == "get_attr" for n in left)      # only the constants, stored as integers


def test_scores_move_with_the_recipes_precision(lm, scorers):
    """Against the float model on held-out tokens: every recipe is off by its quantization (not a float
    copy), 4-bit weights further than 8-bit, 8-bit activations further than 16-bit."""
    ids = torch.randint(0, 1000, (1, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = lm.model(input_ids=ids, use_cache=False).logits
        db = {mode: sqnr_db(s(ids).logits, want) for mode, s in scorers.items()}
    print("logits SQNR against fp32:", {m: round(v, 1) for m, v in db.items()})
    assert all(v < 80 for v in db.values()), db
    assert db["et-16a8w"] > db["et-16a4w"] + 3 and db["et-16a8w"] > db["et-8a8w"] + 3, db


def test_a_prefix_scores_as_in_the_whole_and_the_past_is_the_tokens(scorers):
    """The harness scores a context once and continues each ending from its "past": here the tokens
    themselves, run again; a prefix's logits are those of the whole (static encodings)."""
    s = scorers["et-16a8w"]
    ids = torch.randint(0, 1000, (1, 50), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = s(ids).logits
        head = s(ids[:, :30], logits_to_keep=1)
        tail = s(ids[:, 30:], past_key_values=head.past_key_values)
    assert torch.equal(head.logits[:, -1], whole[:, 29]) and torch.equal(tail.logits, whole[:, 30:])


def test_unknown_recipe_and_generation_are_refused(lm):
    with pytest.raises(LlmNpuError, match="unknown ExecuTorch recipe 'et-4a4w'"):
        recipe_model(lm, "et-4a4w", torch.zeros(1, 8, dtype=torch.long))


def test_eval_scores_a_recipe_beside_our_modes(lm, monkeypatch):
    """``evaluate`` with a recipe mode: a perplexity on the same windows as the others'."""
    from llmnpu_delegate.evaluate import evaluate

    ids = torch.randint(0, 1000, (1200,), generator=torch.Generator().manual_seed(6))
    result = evaluate(lm, ids, ids, ["fp32", "et-16a8w"], window=64, max_tokens=128, progress=False,
                      calib_config=CalibConfig(samples=2, tokens=64))
    fp32, ours = result["results"]["fp32"]["ppl"], result["results"]["et-16a8w"]["ppl"]
    assert ours != fp32 and abs(ours / fp32 - 1) < 0.05, (ours, fp32)


def test_lm_eval_scores_a_recipe_with_one_forward_per_request(lm):
    """``quant=et-16a8w``: multiple-choice endings of one context give the log-likelihoods of scoring
    each whole sequence, one forward each (the scorer keeps no K/V: a shared context run first would
    be a third); generation is refused in one line."""
    pytest.importorskip("lm_eval", reason=missing("lm-eval (the eval extra)"))
    from llmnpu_delegate.harness.lm import LlmNpuLM

    adapter = LlmNpuLM(lm, quant="et-16a8w")
    ctx = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(8)).tolist()
    endings = [[5, 6, 7], [9, 10]]
    calls = []
    hook = adapter.scorer.register_forward_hook(lambda module, args, kwargs, out: calls.append(1), with_kwargs=True)
    got = [score for score, _ in adapter._loglikelihood_tokens([(None, ctx, e) for e in endings])]
    hook.remove()
    assert len(calls) == len(endings)
    for ending, score in zip(endings, got):
        with torch.no_grad():
            logits = adapter.scorer(torch.tensor([ctx + ending])).logits[0, len(ctx) - 1:-1]
        want = float(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ending)[:, None]).sum())
        assert abs(score - want) < 1e-5 * abs(want), (score, want)

    class Request:
        args = ("Once", {"max_gen_toks": 2})
    with pytest.raises(LlmNpuError, match="scores .* and does not generate"):
        adapter.generate_until([Request()])


def test_the_quantizer_does_not_flood_the_terminal(lm, capsys):
    """ExecuTorch's quantizer prints a line per node it leaves unannotated (hundreds per model): none
    reach the user's terminal."""
    recipe_model(lm, "et-8a8w", calibration_samples(calibration_ids(lm), CalibConfig(samples=1, tokens=32)),
                 progress=False)
    out = capsys.readouterr().out
    assert "No quant config" not in out, out[:300]


def test_the_recipes_qnn_program_computes_its_scorer_on_the_htp_simulator(capsys):
    """``llmnpu validate --recipe``: the recipe's converted graph lowered whole to one HTP graph (the
    causal mask and rotary tables folded to constants) gives, on evaluation prompts, the scorer's
    logits far closer than the scorer is to the float model (measured: 66.5 and 65.8 against 40.6
    and 40.5 dB), and the scorer's greedy token at every position. A float program posing as the
    recipe, a wrong mask or a rotary table at the wrong positions would be as far from the scorer as
    fp32 is, or further (tried: an all-true mask reads 6.9 and 5.7 dB; cos(0) wrapped to -1 by the
    lowering, before the fold stored constants as their encodings do, 42.8 and 41.1). R3 is left
    out to keep the lowering short; the embedded model's R3 program is checked by hand
    (docs/results.md)."""
    from llmnpu_delegate.cli import main

    code = main(["validate", "--recipe", "et-16a8w", "--no-r3", "--model", "random:tiny-llama", "--prompts", "2",
                 "--prompt-tokens", "32", "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    report = json.loads(captured.out)
    assert report["recipe"] == "et-16a8w" and not report["r3"] and report["same_next_token"]
    assert len(report["prompts"]) == 2 and report["prompt_tokens"] == 32
    for row in report["prompts"]:
        db = row["logits_sqnr_db"]
        assert db["htp_vs_recipe"] >= db["recipe_vs_fp32"] + 20, row
        assert row["top1_htp_is_recipe"] == 1.0, row


class _TimesCos(torch.nn.Module):
    """x times cos of positions 0..n-1 (a constant at a fixed length), each quantized as a converted
    graph has it; cos's encoding spans [-1, 1] with zero point 32768, so 1.0 is 65,535.7 codes up."""

    def forward(self, x):
        def fake_quant(t, scale, zero_point):
            q = torch.ops.quantized_decomposed
            return q.dequantize_per_tensor.default(
                q.quantize_per_tensor.default(t, scale, zero_point, 0, 65535, torch.uint16),
                scale, zero_point, 0, 65535, torch.uint16)

        angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] / torch.tensor([1.0, 10.0, 100.0, 1000.0])
        return fake_quant(fake_quant(x, 2e-4, 32768) * fake_quant(torch.cos(angles), 1.99999 / 65535, 32768),
                          2e-4, 32768)


def test_a_folded_constant_at_the_top_of_its_encoding_keeps_its_value_on_htp():
    """ExecuTorch's QNN lowering quantizes a constant itself, rounding without a clamp: cos(0) = 1.0
    rounds to code 65,536 and wrapped to 0, -1.0, so the embedded model's first block turned every
    query at position 0 (and wherever a slow rotary frequency keeps cos near 1) around, 22.8 dB from
    its scorer. The fold stores each constant as its encoding does, and the program computes the
    graph's numbers on the simulator: within a step of the output encoding."""
    from executorch.runtime import Runtime

    from llmnpu_delegate import backends
    from llmnpu_delegate.recipes import recipe_program

    x = torch.linspace(-3, 3, 64 * 4).reshape(64, 4)
    with torch.no_grad():
        want = _TimesCos()(x)
    backends.get("qnn").prepare_runtime()
    got = Runtime.get().load_program(recipe_program(_TimesCos(), x, "SM8650")).load_method("forward").execute([x])[0]
    assert (got - want).abs().max() <= 2e-4 * 1.01, (got - want).abs().max()


def test_a_recipe_graph_htp_will_not_run_whole_is_a_one_line_error(lm):
    """8-bit activations with R3: HTP's HadamardTransform takes 16-bit ones only, so the rotation would
    stay on the CPU; the program is refused in one line that says so, not written half-delegated."""
    from llmnpu_delegate.recipes import recipe_converted, recipe_program

    samples = calibration_samples(calibration_ids(lm), CalibConfig(samples=1, tokens=32))
    converted = recipe_converted(lm, "et-8a8w", samples, progress=False)
    with pytest.raises(LlmNpuError, match=r"^HTP refused part of the recipe's graph \(hadamard_transform\).*--no-r3\)$"):
        recipe_program(converted, samples[:, :16], "SM8650")


@pytest.mark.parametrize("argv, message", [
    (["--pte", "model.pte", "--soc", "SM8750"], "--soc go with --recipe: a .pte carries its own model and SoC"),
    (["--recipe", "et-16a8w", "--prompts", "0"], "--prompts must be at least 1 and --prompt-tokens at least 2"),
])
def test_validate_options_that_do_not_fit_are_one_line_errors(argv, message, capsys):
    from llmnpu_delegate.cli import main

    assert main(["validate", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
