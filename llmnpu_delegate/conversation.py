"""``llmnpu chat``: a conversation whose every turn prefills only what is new.

Each turn sends the whole history through the tokenizer's chat template, as any chat front end
does; the runner's prefix cache (``runtime/prefix_cache.py``) finds the part it has already
prefilled, so the turn's prefill covers the previous answer and the new message only. Three
responders: the wrapper (``LlmNpuForCausalLM``, the engine), an exported program on the Python
reference runner (``PteRunner``), or on the native runner (``llmnpu-runner --serve``).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from transformers import TextStreamer

from .errors import LlmNpuError
from .paths import atomic_path
from .runtime.sampling import GREEDY, Sampling

SAVE_FORMAT = "llmnpu-chat"
COMMANDS = {"/reset": "forget the conversation (cached K/V stay, so a new one with the same start reuses it)",
            "/save FILE": "write the conversation to FILE (JSON)",
            "/load FILE": "continue the conversation saved in FILE",
            "/help": "this list"}


@dataclass
class Reply:
    text: str
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int            # prompt tokens whose K/V came from the prefix cache
    ttft_s: float
    decode_tok_s: float | None

    def status(self) -> str:
        speed = f", {self.decode_tok_s:.1f} tok/s" if self.decode_tok_s else ""
        return (f"[ttft {1e3 * self.ttft_s:.0f} ms · prompt {self.prompt_tokens} tokens, {self.cached_tokens} from "
                f"the cache · {len(self.tokens)} new tokens{speed}]")


class WrapperResponder:
    """Turns answered by ``LlmNpuForCausalLM.generate`` (the engine prefill, CPU decode)."""

    def __init__(self, wrapper, max_new_tokens: int, sampling: dict):
        if wrapper.engine.prefix_cache is None:
            raise LlmNpuError("a chat needs the wrapper's prefix cache: build it with prefix_cache=True")
        self.wrapper, self.tokenizer = wrapper, wrapper.tokenizer
        self.max_new_tokens, self.sampling = max_new_tokens, sampling

    def reply(self, ids: torch.Tensor, on_token: Callable[[int], None] | None) -> Reply:
        from .generation import TokenClock

        clock = TokenClock(_Forward(on_token) if on_token else None)
        start = time.perf_counter()
        out = self.wrapper.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                                    max_new_tokens=self.max_new_tokens, streamer=clock,
                                    pad_token_id=self.tokenizer.eos_token_id, **self.sampling)
        tokens = out[0, ids.numel():].tolist()
        times = clock.times
        decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        pre = self.wrapper.last_prefill
        return Reply(self.tokenizer.decode(tokens, skip_special_tokens=True), tokens, ids.numel(),
                     pre["cached_tokens"], times[0] - start if times else 0.0,
                     (len(times) - 1) / decode_s if decode_s > 0 else None)


class _Forward:
    """A streamer that hands each generated token id to a callback (transformers' streamers get
    tensors; the prompt comes first and is skipped by ``TokenClock``'s caller)."""

    def __init__(self, on_token):
        self.on_token, self.prompt_seen = on_token, False

    def put(self, value):
        if self.prompt_seen:
            for t in value.reshape(-1).tolist():
                self.on_token(t)
        self.prompt_seen = True

    def end(self):
        pass


class PteResponder:
    """Turns answered by an exported program on the Python reference runner (its prefix cache on)."""

    def __init__(self, runner, tokenizer, max_new_tokens: int, sampling: Sampling = GREEDY):
        if runner.prefix_cache is None:
            raise LlmNpuError("a chat needs the runner's prefix cache: build PteRunner with prefix_cache=...")
        self.runner, self.tokenizer = runner, tokenizer
        self.max_new_tokens, self.sampling = max_new_tokens, sampling

    def reply(self, ids: torch.Tensor, on_token: Callable[[int], None] | None) -> Reply:
        room = self.runner.context - ids.numel() + 1
        if room < 1:
            raise LlmNpuError(f"the conversation has {ids.numel()} tokens, the program's context is "
                              f"{self.runner.context}: /reset, or export with a larger --context")
        g = self.runner.generate(ids, min(self.max_new_tokens, room), self.sampling,
                                 self.runner.meta["tokenizer"]["eos_ids"], on_token)
        return Reply(self.tokenizer.decode(g.tokens, skip_special_tokens=True), g.tokens, g.prompt_tokens,
                     g.cached_tokens, g.ttft_s, g.decode_tok_s)


class NativeResponder:
    """Turns answered by an exported program on the native runner, one ``--serve`` process that keeps
    the last prompt's K/V (``runtime/native.NativeSession``)."""

    def __init__(self, session, context: int, tokenizer, max_new_tokens: int):
        self.session, self.context, self.tokenizer, self.max_new_tokens = session, context, tokenizer, max_new_tokens

    def reply(self, ids: torch.Tensor, on_token: Callable[[int], None] | None) -> Reply:
        room = self.context - ids.numel() + 1
        if room < 1:
            raise LlmNpuError(f"the conversation has {ids.numel()} tokens, the program's context is "
                              f"{self.context}: /reset, or export with a larger --context")
        run = self.session.turn(ids.tolist(), min(self.max_new_tokens, room), on_token)
        s = run.summary
        return Reply(self.tokenizer.decode(run.tokens, skip_special_tokens=True), run.tokens, s["prompt_tokens"],
                     s["cached_tokens"], s["ttft_s"], s["decode_tok_s"])

    def close(self) -> None:
        self.session.close()


class Conversation:
    """A history of messages and the responder that answers it, turn by turn."""

    def __init__(self, responder, system: str | None = None):
        tok = responder.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise LlmNpuError("this model's tokenizer has no chat template: a chat needs one (use llmnpu run)")
        self.responder, self.system = responder, system
        self.messages: list[dict] = []

    def ids(self) -> torch.Tensor:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        return self.responder.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                                            return_dict=True)["input_ids"][0]

    def say(self, text: str, on_token: Callable[[int], None] | None = None) -> Reply:
        if not text.strip():
            raise LlmNpuError("the message is empty: type some text")
        self.messages.append({"role": "user", "content": text})
        try:
            reply = self.responder.reply(self.ids(), on_token)
        except BaseException:
            self.messages.pop()                  # the turn did not happen
            raise
        self.messages.append({"role": "assistant", "content": reply.text})
        return reply

    def reset(self) -> None:
        self.messages = []

    def save(self, path: str | Path) -> None:
        with atomic_path(Path(path)) as tmp:
            tmp.write_text(json.dumps({"format": SAVE_FORMAT, "version": 1, "system": self.system,
                                       "messages": self.messages}, indent=1))

    def load(self, path: str | Path) -> None:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise LlmNpuError(f"cannot read the conversation {path} ({type(e).__name__}): give a file /save wrote")
        msgs = d.get("messages") if isinstance(d, dict) and d.get("format") == SAVE_FORMAT else None
        if not isinstance(msgs, list) or not all(_is_message(m) for m in msgs):
            raise LlmNpuError(f"{path} is not a conversation written by /save: give a file /save wrote")
        self.system, self.messages = d.get("system"), msgs


def _is_message(m) -> bool:
    return (isinstance(m, dict) and m.get("role") in ("user", "assistant")
            and isinstance(m.get("content"), str))


def read_turns(path: str) -> Iterable[str]:
    """``--turns``: one JSON message per line (``{"role": "user", "content": ...}``, or a command
    as ``{"command": "/reset"}``), from a file or ``-`` (stdin); blank lines are skipped."""
    f = sys.stdin if path == "-" else _open(path)
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError:
            raise LlmNpuError(f"{path}:{n} is not JSON: write one JSON message per line") from None
        if isinstance(d, dict) and isinstance(d.get("command"), str):
            yield d["command"]
        elif isinstance(d, dict) and d.get("role") == "user" and isinstance(d.get("content"), str):
            yield d["content"] if not d["content"].startswith("/") else " " + d["content"]
        else:
            raise LlmNpuError(f'{path}:{n}: expected {{"role": "user", "content": TEXT}} or {{"command": "/reset"}}')


def _open(path: str):
    try:
        return open(path)
    except OSError as e:
        raise LlmNpuError(f"cannot read the turns file {path} ({e.strerror})") from None


def interactive_lines() -> Iterable[str]:
    """Lines typed at the terminal (a prompt is shown) or piped in."""
    tty = sys.stdin.isatty()
    while True:
        try:
            line = input("you> ") if tty else sys.stdin.readline()
        except EOFError:
            return
        if not tty and line == "":
            return
        yield line.rstrip("\n")


def chat_loop(conv: Conversation, lines: Iterable[str], stream: bool = True, out=None,
              keep_going: bool = False) -> list[dict]:
    """Answer each line (a message, or a command); returns every turn's record. ``keep_going`` (a
    person at a terminal): a refused line prints its error and the chat goes on."""
    out = out or sys.stdout
    records: list[dict] = []
    for line in lines:
        if not line.strip():
            continue
        try:
            records.append(_command(conv, line, out) if line.startswith("/") else _turn(conv, line, stream, out))
        except LlmNpuError as e:
            if not keep_going:
                raise
            print(f"llmnpu: error: {e}", file=sys.stderr, flush=True)
    turns = [r for r in records if "text" in r]
    for n, r in enumerate(turns, 1):
        r["turn"] = n
    return records


def _turn(conv: Conversation, line: str, stream: bool, out) -> dict:
    printer = TextStreamer(conv.responder.tokenizer, skip_special_tokens=True) if stream else None
    on_token = (lambda t: printer.put(torch.tensor([t]))) if printer else None
    reply = conv.say(line.strip(), on_token)
    if printer:
        printer.end()
        print(reply.status(), file=out, flush=True)
    return asdict(reply)


def _command(conv: Conversation, line: str, out) -> dict:
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name == "/reset":
        conv.reset()
        print("[conversation reset]", file=out, flush=True)
    elif name in ("/save", "/load"):
        if not arg:
            raise LlmNpuError(f"{name} needs a file: {name} FILE")
        conv.save(arg) if name == "/save" else conv.load(arg)
        print(f"[{'saved to' if name == '/save' else 'loaded'} {arg}: {len(conv.messages)} messages]", file=out,
              flush=True)
    elif name == "/help":
        print("\n".join(f"  {c:<11} {what}" for c, what in COMMANDS.items()), file=out, flush=True)
    else:
        raise LlmNpuError(f"unknown command {name}: use one of {', '.join(c.split()[0] for c in COMMANDS)}")
    return {"command": line.strip()}
