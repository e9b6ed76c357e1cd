"""``llmnpu chat``: turns that prefill only what is new, against the same turns prefilled whole;
commands, saved conversations and the turns file."""
import json

import pytest
import torch

from llmnpu_delegate.conversation import Conversation, Reply, chat_loop, read_turns
from llmnpu_delegate.cli import main
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.models import load_model


def _turns(path, *lines) -> str:
    path.write_text("\n".join(json.dumps({"command": x} if x.startswith("/") else {"role": "user", "content": x})
                              for x in lines) + "\n")
    return str(path)


def _chat(capsys, *args) -> list[dict]:
    # a fixed pruning and placement: automatic ones are chosen by timing this machine's engine
    assert main(["chat", "--max-new-tokens", "8", "--no-progress", "--json", "--pruning-rate", "0",
                 "--placement", "paper", *args]) == 0
    return [r for r in json.loads(capsys.readouterr().out)["turns"] if "text" in r]


@pytest.mark.slow
def test_chat_on_the_embedded_model_prefills_only_what_is_new(smollm2, tmp_path, capsys):
    saved, kv = tmp_path / "conv.json", tmp_path / "kv"
    first = _chat(capsys, "--turns", _turns(tmp_path / "a.jsonl", "What is the capital of France?",
                                            "And of Germany?", f"/save {saved}", "/reset",
                                            "What is the capital of France?"),
                  "--kv-cache-dir", str(kv))
    one, two, again = first
    assert one["cached_tokens"] == 0
    assert two["cached_tokens"] == one["prompt_tokens"]          # turn 1's whole prompt
    # the same question after /reset: wholly cached but its last token, and the same answer
    assert again["cached_tokens"] == one["prompt_tokens"] - 1 and again["tokens"] == one["tokens"]
    # another process (a new prefix cache on the same folder) resumes the saved conversation from the
    # K/V on disk, and answers as one that prefills the whole history
    from llmnpu_delegate.conversation import WrapperResponder
    from llmnpu_delegate.hf import LlmNpuForCausalLM
    from llmnpu_delegate.runtime.prefix_cache import PrefixCache

    wrapper = LlmNpuForCausalLM(smollm2, pruning_rate=0.0, progress=False)
    replies = []
    for cache in (PrefixCache(directory=kv), PrefixCache()):
        wrapper.engine.prefix_cache = cache
        conv = Conversation(WrapperResponder(wrapper, 8, {"do_sample": False}))
        conv.load(saved)
        replies.append(conv.say("And of Italy?"))
    resumed, whole = replies
    assert resumed.cached_tokens >= two["prompt_tokens"] and whole.cached_tokens == 0
    assert resumed.prompt_tokens == whole.prompt_tokens and resumed.tokens == whole.tokens


class _Echo:
    """A responder that answers with the number of prompt tokens (no model)."""

    def __init__(self):
        self.tokenizer = load_model("random:tiny-llama").tokenizer
        self.prompts = []

    def reply(self, ids, on_token):
        self.prompts.append(ids)
        if on_token:
            on_token(5)
        return Reply(f"{ids.numel()} tokens", [5], ids.numel(), 0, 0.01, None)


def test_commands_save_load_and_refusals(tmp_path, capsys):
    echo = _Echo()
    conv = Conversation(echo, system="be brief")
    path = tmp_path / "c.json"
    lines = ["hello there, how are you", f"/save {path}", "/reset", "hi", f"/load {path}", "more"]
    records = chat_loop(conv, lines, stream=False)
    assert [r.get("turn") for r in records] == [1, None, None, 2, None, 3]
    # after /reset the history is one message; after /load it is the saved two plus the new one
    assert echo.prompts[1].numel() < echo.prompts[0].numel() < echo.prompts[2].numel()
    assert torch.equal(echo.prompts[2][:echo.prompts[0].numel() - 3], echo.prompts[0][:-3])
    assert json.loads(path.read_text())["messages"][0] == {"role": "user", "content": "hello there, how are you"}
    with pytest.raises(LlmNpuError, match="unknown command /bogus"):
        chat_loop(conv, ["/bogus"])
    with pytest.raises(LlmNpuError, match="/save needs a file"):
        chat_loop(conv, ["/save"])
    (tmp_path / "bad.json").write_text('{"messages": 3}')
    with pytest.raises(LlmNpuError, match="not a conversation written by /save"):
        conv.load(tmp_path / "bad.json")
    # at a terminal a refused line is an error message, and the chat goes on
    records = chat_loop(conv, ["/bogus", "still here"], stream=False, keep_going=True)
    assert "unknown command" in capsys.readouterr().err and records[-1]["text"].endswith("tokens")
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"role": "user", "content": "hi"}\nnot json\n')
    with pytest.raises(LlmNpuError, match="t.jsonl:2 is not JSON"):
        list(read_turns(str(bad)))
    bad.write_text('{"role": "assistant", "content": "hi"}\n')
    with pytest.raises(LlmNpuError, match='expected {"role": "user"'):
        list(read_turns(str(bad)))


def test_chat_command_refusals(tmp_path, capsys):
    assert main(["chat", "--native", "--turns", "x"]) == 2
    assert "--native runs an exported program" in capsys.readouterr().err
    assert main(["chat", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be at least 1" in capsys.readouterr().err
    assert main(["chat", "--kv-cache-mb", "-1"]) == 2
    assert "--kv-cache-mb must be >= 0" in capsys.readouterr().err
    assert main(["chat", "--pte", "m.pte", "--native", "--kv-cache-dir", str(tmp_path)]) == 2
    assert "keeps the last prompt's K/V in its own memory" in capsys.readouterr().err
