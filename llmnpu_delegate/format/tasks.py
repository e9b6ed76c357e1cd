"""The task graph of one prompt's prefill: task (chunk i, subgraph j) on its processor.

Dependencies come from the data flow of the partitioned chunk step, which gives exactly the
paper's two rules: *intra-chunk* (a subgraph needs the subgraphs of its chunk that produce its
inputs) and *cross-chunk* (layer l's attention of chunk i reads the K/V that layer l's attention
of chunk i-1 produced, which covers chunks 0..i-1). Non-final chunks skip what only feeds the
logits (the last layer's MLP and lm_head).

``dependency_table`` states the rules once, as data: the exported program carries it in its
sidecar, and every runner (the executor, the native one) and ``llmnpu simulate`` expand it with
``expand``'s logic.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def past_name(kind: str, layer: int) -> str:
    """Input name of one layer's past K (``kind="k"``) or V in the chunk step."""
    return f"past_{kind}_{layer}"



@dataclass
class Task:
    id: int
    chunk: int
    step: int                 # index into ChunkProgram.steps
    processor: str            # "npu" | "cpu"
    deps: list[int] = field(default_factory=list)
    users: list[int] = field(default_factory=list)
    cost: float = 0.0         # profiled seconds on its processor

    @property
    def key(self) -> tuple[int, int]:
        return (self.chunk, self.step)


def dependency_table(program) -> dict:
    """Of a ``runtime.program.ChunkProgram`` (its steps' subgraphs and the K/V it hands on), per step: ``after`` (steps of its own chunk that produce its inputs) and ``after_previous``
    (steps of the chunk before that produce its past K/V); ``needed_kv`` / ``needed_final``: the
    steps a non-final / the final chunk runs; ``processors``: each step's processor."""
    after, after_previous = data_flow([(s.sub.inputs, s.sub.outputs) for s in program.steps],
                                      program.out_k, program.out_v)
    return {"after": after, "after_previous": after_previous,
            "needed_kv": list(program.needed_kv), "needed_final": list(program.needed_final),
            "processors": [s.sub.processor for s in program.steps]}


def data_flow(steps: list[tuple[list[str], list[str]]], out_k: list[str], out_v: list[str]) -> tuple[list, list]:
    """``after`` and ``after_previous`` of steps given as (inputs, outputs) in program order;
    ``out_k`` / ``out_v``: the values each layer hands to the next chunk as its past K / V."""
    producer: dict[str, int] = {}
    after = []
    for j, (inputs, outputs) in enumerate(steps):
        after.append(sorted({producer[n] for n in inputs if n in producer}))
        producer.update({name: j for name in outputs})
    past = {past_name("k", i): producer[k] for i, k in enumerate(out_k)}
    past.update({past_name("v", i): producer[v] for i, v in enumerate(out_v)})
    return after, [sorted({past[n] for n in inputs if n in past}) for inputs, _ in steps]


def expand(table: dict, chunks: int) -> list[Task]:
    """The tasks of a ``chunks``-chunk prompt from a ``dependency_table``, in program order."""
    tasks: list[Task] = []
    previous: dict[int, int] = {}          # step -> its task in the chunk before
    for i in range(chunks):
        current: dict[int, int] = {}
        for j in table["needed_final"] if i == chunks - 1 else table["needed_kv"]:
            t = Task(len(tasks), i, j, table["processors"][j])
            t.deps = [current[d] for d in table["after"][j]] + [previous[d] for d in table["after_previous"][j]
                                                                 if i > 0]
            current[j] = t.id
            tasks.append(t)
        previous = current
    for t in tasks:
        for d in t.deps:
            tasks[d].users.append(t.id)
    return tasks


def build_tasks(program, chunks: int) -> list[Task]:
    return expand(dependency_table(program), chunks)
