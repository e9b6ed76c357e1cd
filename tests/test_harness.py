"""The lm-eval door: the adapter's scores against independent computations, the offline tasks, and a
user's task end to end through lm_eval."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import missing

pytest.importorskip("lm_eval", reason=missing("lm-eval (the eval extra)"))
from lm_eval.api.instance import Instance  # noqa: E402

from llmnpu_delegate.cli import main as cli_main  # noqa: E402
from llmnpu_delegate.errors import LlmNpuError  # noqa: E402
from llmnpu_delegate.evaluate import perplexity  # noqa: E402
from llmnpu_delegate.harness.lm import LlmNpuLM  # noqa: E402
from llmnpu_delegate.harness.suite import run_tasks  # noqa: E402
from llmnpu_delegate.harness.offline_tasks import TASKS, sentences, task_dir  # noqa: E402
from llmnpu_delegate.models import load_model  # noqa: E402
from llmnpu_delegate.quantize import CalibConfig, QuantConfig, calibrate  # noqa: E402
from llmnpu_delegate.text import read_text, tokenize  # noqa: E402

PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " the city of Lyon"), ("Water boils at a temperature of one hundred", " degrees Celsius."),
         ("", "Once upon a time")]


def _requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def fp32_lm(smollm2):
    return LlmNpuLM(smollm2, quant="fp32")


@torch.inference_mode()
def _step_by_step(lm, context: list[int], continuation: list[int]) -> float:
    """Σ log p(continuation) one token at a time through the model's own KV cache: no shared code with
    the adapter's single forward."""
    out = lm.model(input_ids=torch.tensor([context]), use_cache=True)
    total, past = 0.0, out.past_key_values
    logits = out.logits[0, -1]
    for tok in continuation:
        total += float(F.log_softmax(logits.double(), -1)[tok])
        out = lm.model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return total


def test_loglikelihood_equals_a_step_by_step_float_computation(fp32_lm, smollm2):
    got = fp32_lm.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)
    tok = smollm2.tokenizer
    for (context, continuation), (score, greedy) in zip(PAIRS, got):
        if context:
            ctx = tok.encode(context, add_special_tokens=False)
            cont = tok.encode(context + continuation, add_special_tokens=False)[len(ctx):]
        else:   # lm-eval conditions an empty context on the end-of-text token
            ctx, cont = [tok.eos_token_id], tok.encode(continuation, add_special_tokens=False)
        want = _step_by_step(smollm2, ctx, cont)
        assert abs(score - want) <= 1e-4, (context, score, want)
        assert score < 0 and isinstance(greedy, bool)
    assert got[0][1], "' Paris' is the float model's greedy continuation here"


def test_rolling_loglikelihood_equals_the_perplexity_harness(fp32_lm, smollm2):
    text = read_text(None, "eval")[:2500]
    ids = tokenize(smollm2, text).tolist()
    assert len(ids) + 1 <= fp32_lm.max_length      # one window: the harness's scheme is one forward
    (got,) = fp32_lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    ppl = perplexity(smollm2.model, torch.tensor([[smollm2.tokenizer.eos_token_id] + ids]), progress=False)
    assert abs(got + math.log(ppl) * len(ids)) <= 1e-4 * len(ids), (got, ppl)
    # several windows: lm-eval's rolling scheme scores every token exactly once
    short = LlmNpuLM(smollm2, quant="fp32", max_length=256)
    (windows,) = short.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    assert windows < 0 and abs(windows - got) > 1e-3     # less context per token: a different sum


def test_quantized_scores_follow_the_engine():
    """The adapter's quantized reference against the chunked engine (an independent implementation),
    on a random model with outlier channels: within a tenth of what quantization changes. (On the
    embedded model a float-level change alone, e.g. another attention implementation, moves the
    quantized logits as much as quantization does: its 25,000 activations flip roundings.)"""
    from conftest import assert_within_quant_effect, outlier_model

    from llmnpu_delegate.backends.graph_cache import GraphCache
    from llmnpu_delegate.runtime.engine import Prefiller

    lm = outlier_model()
    calib = calibrate(lm.model, torch.randint(0, 1000, (256,)), lm.fingerprint,
                      CalibConfig(samples=4, tokens=64, probe_tokens=64), progress=False)
    adapter = LlmNpuLM(lm, quant="w8a8-shadow", calibration=calib)
    ids = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(5))
    engine = Prefiller(lm, 32, quant=QuantConfig(outliers="shadow", pruning_rate=0.0), calibration=calib,
                       cache=GraphCache(), progress=False, attention="fp32")
    assert engine.partition.by_kind("shadow")
    got = adapter._logprobs(ids.tolist())[0][-1]
    with torch.inference_mode():
        float_logp = F.log_softmax(lm.model(input_ids=ids[None]).logits[0, -1].float(), -1)
    assert_within_quant_effect(got, F.log_softmax(engine(ids).logits.float(), -1), float_logp)
    nxt = int(got.argmin())
    (score, greedy), = adapter._loglikelihood_tokens([(None, ids.tolist(), [nxt])], disable_tqdm=True)
    assert not greedy and abs(score - float(got[nxt])) <= 1e-5


def test_a_placement_with_attention_on_the_npu_scores_as_the_engine_runs_it():
    """The adapter under placement attention-half (its attention at the NPU's 16-bit encodings,
    placed_numerics.py) against the chunked engine under the same placement (its stand-in NPU runs
    kernels/npu_attention.py inside the FX graph's NPU region): within a tenth of what moving
    attention to the NPU changes. Paper-placement adapter and engine bracket it: were the placement
    ignored, the adapter would sit a whole effect away."""
    from conftest import assert_within_quant_effect, outlier_model

    from llmnpu_delegate.backends.graph_cache import GraphCache
    from llmnpu_delegate.runtime.engine import Prefiller

    lm = outlier_model()
    calib = calibrate(lm.model, torch.randint(0, 1000, (256,)), lm.fingerprint,
                      CalibConfig(samples=4, tokens=64, probe_tokens=64), progress=False)
    ids = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(5))
    quant = QuantConfig(outliers="shadow", pruning_rate=0.0)
    got, want = {}, {}
    for placement in ("paper", "attention-half"):
        adapter = LlmNpuLM(lm, quant="w8a8-shadow", calibration=calib, chunk_len=32, placement=placement)
        got[placement] = adapter._logprobs(ids.tolist())[0][-1]
        engine = Prefiller(lm, 32, quant=quant, calibration=calib, cache=GraphCache(), progress=False,
                           attention="fp32", placement=placement)
        want[placement] = F.log_softmax(engine(ids).logits.float(), -1)
    npu, paper = want["attention-half"], want["paper"]
    err, effect = assert_within_quant_effect(got["attention-half"], npu, paper)
    assert_within_quant_effect(got["paper"], paper, npu)
    print(f"NPU attention: adapter {err:.2e} from the engine, the placement's effect {effect:.2e}")
    # an 8-bit window is another grid: the adapter follows it too
    eight = LlmNpuLM(lm, quant="w8a8-shadow", calibration=calib, chunk_len=32, placement="block", npu_kv_bits=8)
    assert not torch.equal(eight._logprobs(ids.tolist())[0][-1], got["attention-half"])
    # generation tasks run the engine under the same placement and window
    config = eight.wrapper.engine.config
    assert str(config.placement) == "block" and config.npu_kv_bits == 8
    with pytest.raises(LlmNpuError, match="apply to the quantization modes"):
        LlmNpuLM(lm, quant="fp32", placement="block")
    with pytest.raises(LlmNpuError, match="8 or 16 bits"):
        LlmNpuLM(lm, quant="w8a8-shadow", calibration=calib, placement="block", npu_kv_bits=4)


def test_offline_tasks_are_deterministic_and_from_the_evaluation_text(tmp_path, monkeypatch):
    folder = task_dir()
    first = {t: (folder / f"{t}.jsonl").read_bytes() for t in TASKS}
    monkeypatch.setenv("LLMNPU_CACHE_DIR", str(tmp_path))
    again = task_dir()
    assert again != folder and {t: (again / f"{t}.jsonl").read_bytes() for t in TASKS} == first
    calib, text = read_text(None, "calib"), read_text(None, "eval")
    cloze = [json.loads(line) for line in first["llmnpu_cloze"].splitlines()]
    nexts = [json.loads(line) for line in first["llmnpu_nextsentence"].splitlines()]
    pages = [json.loads(line) for line in first["llmnpu_wikitext"].splitlines()]
    assert len(cloze) == 500 and len(nexts) == 500 and len(pages) == 20
    for d in cloze:
        word = d["target"].strip()
        assert (d["context"] + d["target"]) in text and d["context"][:200] not in calib
        assert word.lower() in d["context"].lower()               # the context holds the answer
    for d in nexts:
        true = d["choices"][d["label"]].strip()
        assert (d["query"] + " " + true) in text and len(d["choices"]) == 4 and len(set(d["choices"])) == 4
        assert all(c.strip() not in d["query"] for i, c in enumerate(d["choices"]) if i != d["label"])
    assert [d["label"] for d in nexts].count(0) < 200              # the true ending is not always first
    assert all(p["page"][:200] in text for p in pages)
    assert sentences("One. Two three? Four") == ["One.", "Two three?", "Four"]


DOCS = [{"q": c, "a": a} for c, a in PAIRS[:3]] + [{"q": "One, two, three, four,", "a": " five"}]


@pytest.fixture(scope="module")
def user_task(tmp_path_factory, fp32_lm):
    """A user's own lm-eval task (YAML + JSON lines) and the accuracy it must score, computed here."""
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "mine.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "mine.yaml").write_text(
        "task: my_cloze\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(folder / 'mine.jsonl'))}\ntest_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\nmetric_list:\n  - metric: acc\n    aggregation: mean\n'
        "    higher_is_better: true\n")
    greedy = [g for _, g in fp32_lm.loglikelihood(_requests("loglikelihood", [(d["q"], d["a"]) for d in DOCS]),
                                                  disable_tqdm=True)]
    acc = sum(greedy) / len(DOCS)
    assert 0 < acc < 1
    return folder, acc


def test_a_users_task_end_to_end_through_lm_eval(user_task, smollm2):
    """A user's YAML (--include-path) through lm_eval.simple_evaluate."""
    folder, acc = user_task
    result = run_tasks(smollm2, ["my_cloze"], ["fp32"], include_path=str(folder), progress=False)
    assert result["samples"]["my_cloze"] == 4
    assert result["results"]["fp32"]["my_cloze"]["acc"][0] == pytest.approx(acc)


def test_lm_eval_rows_per_placement(capsys):
    """`eval --tasks` with --placement: a row per placement of the quantization mode; attention on the
    NPU moves the cloze perplexity (a placement that leaves attention on the CPU scores as the paper's:
    tests/test_evaluate.py)."""
    cmd = ["eval", "--model", "random:tiny-llama", "--tasks", "llmnpu_cloze", "--limit", "4", "--modes",
           "w8a8-shadow", "--pruning-rate", "0", "--placement", "paper", "attention-half", "--no-progress", "--json"]
    assert cli_main(cmd) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert list(rows) == ["w8a8-shadow", "w8a8-shadow@attention-half"]
    ppl = {name: row["llmnpu_cloze"]["perplexity"][0] for name, row in rows.items()}
    assert ppl["w8a8-shadow"] != ppl["w8a8-shadow@attention-half"]


def test_the_lm_eval_command_line_finds_the_llmnpu_model(user_task):
    """``llmnpu-lm-eval``: lm_eval's own command line with ``--model llmnpu`` (the README's line)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    folder, acc = user_task
    exe = Path(sys.executable).with_name("llmnpu-lm-eval")
    run = subprocess.run([str(exe), "--model", "llmnpu", "--model_args", "quant=fp32", "--tasks", "my_cloze",
                          "--include_path", str(folder)], capture_output=True, text=True,
                         env={**os.environ, "HF_DATASETS_OFFLINE": "1"}, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    row = next(line for line in run.stdout.splitlines() if line.startswith("|my_cloze")).split("|")
    assert row[5].strip() == "acc" and float(row[7]) == pytest.approx(acc, abs=1e-4), row


def test_bad_arguments_get_one_line_errors(smollm2, capsys):
    with pytest.raises(LlmNpuError, match="unknown quant 'int4'"):
        LlmNpuLM(smollm2, quant="int4")
    with pytest.raises(LlmNpuError, match="only apply to the shadow modes"):
        LlmNpuLM(smollm2, quant="w8a8", pruning_rate=0.5)
    with pytest.raises(LlmNpuError, match="unknown model_args"):
        LlmNpuLM(smollm2, quant="fp32", pretrained="gpt2")
    with pytest.raises(LlmNpuError, match="unknown task"):
        run_tasks(smollm2, ["no_such_task"], ["fp32"], progress=False)
    assert cli_main(["eval", "--limit", "3", "--no-progress"]) == 2
    assert "--limit go with --tasks" in capsys.readouterr().err


def test_generation_is_the_float_models_own_in_fp32_mode(smollm2):
    """generate_until through the product's prefill and decode (fp32 mode) against transformers' own
    greedy generate, cut at the stop string as lm-eval asks."""
    adapter = LlmNpuLM(smollm2, quant="fp32", decode="fp32")
    prompts = ["The capital of France is", "A lighthouse is a tower that"]
    got = adapter.generate_until(_requests("generate_until", [(p, {"until": ["."], "max_gen_toks": 12})
                                                              for p in prompts]), disable_tqdm=True)
    tok = smollm2.tokenizer
    for prompt, text in zip(prompts, got):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            want = smollm2.model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
        assert text == tok.decode(want, skip_special_tokens=True).split(".")[0] and text
    with pytest.raises(LlmNpuError, match="greedily"):
        adapter.generate_until(_requests("generate_until", [(prompts[0], {"do_sample": True})]), disable_tqdm=True)


def test_the_lm_eval_command_line_scores_a_quantized_mode_as_the_adapter_does(user_task, tmp_path):
    """``llmnpu-lm-eval --model_args model=...,quant=w8a8``: each sample's log-likelihood, as lm_eval
    logged it, is the adapter's own for that model in that mode, and not the float model's (a door
    that ignored ``quant=`` would give those). A random model: the door is under test, not the
    embedded model's calibration (the command line on that model: the test above)."""
    import glob
    import os
    import subprocess
    import sys
    from pathlib import Path

    folder, _ = user_task
    exe = Path(sys.executable).with_name("llmnpu-lm-eval")
    run = subprocess.run([str(exe), "--model", "llmnpu", "--model_args", "model=random:tiny-llama,quant=w8a8",
                          "--tasks", "my_cloze",
                          "--include_path", str(folder), "--log_samples", "--output_path", str(tmp_path)],
                         capture_output=True, text=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1"}, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    (log,) = glob.glob(str(tmp_path / "**" / "samples_my_cloze_*.jsonl"), recursive=True)
    pairs, got = [], []
    for line in Path(log).read_text().splitlines():
        s = json.loads(line)
        args = s["arguments"]          # what lm_eval asked the model (its target delimiter included)
        pair = next(iter(args.values())) if isinstance(args, dict) else args[0]
        pairs.append((pair["arg_0"], pair["arg_1"]) if isinstance(pair, dict) else tuple(pair))
        got.append(float(s["filtered_resps"][0][0]))
    assert len(pairs) == len(DOCS)
    requests = _requests("loglikelihood", pairs)
    lm = load_model("random:tiny-llama")
    ours = [ll for ll, _ in LlmNpuLM(lm, quant="w8a8").loglikelihood(requests, disable_tqdm=True)]
    floats = [ll for ll, _ in LlmNpuLM(lm, quant="fp32").loglikelihood(requests, disable_tqdm=True)]
    assert got == pytest.approx(ours, abs=1e-5)
    # what quantization changes is far larger than that (5e-3 measured on this model: 500x)
    assert max(abs(a - b) for a, b in zip(ours, floats)) > 1e-3, (ours, floats)


def test_the_lm_eval_door_opens_on_lm_evals_own_usage():
    """``llmnpu-lm-eval --help``: lm_eval's usage first, no other library's import-time notices."""
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([str(Path(sys.executable).with_name("llmnpu-lm-eval")), "--help"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0
    assert run.stdout.startswith("usage: lm-eval") and run.stderr == "", run.stderr[:500]
