"""The task graph of one prompt's prefill: task (chunk i, subgraph j) on its processor.

Dependencies come from the data flow of the partitioned chunk step, which gives exactly the
paper's two rules: *intra-chunk* (a subgraph needs the subgraphs of its chunk that produce its
inputs) and *cross-chunk* (layer l's attention of chunk i reads the K/V that layer l's attention
of chunk i-1 produced, which covers chunks 0..i-1). Non-final chunks skip what only feeds the
logits (the last layer's MLP and lm_head).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .program import ChunkProgram, past_name


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


def build_tasks(program: ChunkProgram, chunks: int) -> list[Task]:
    tasks: list[Task] = []
    index: dict[tuple[int, int], int] = {}
    producer_prev: dict[str, int] = {}     # past_* input name of chunk i -> task of chunk i-1
    for i in range(chunks):
        steps = program.needed_final if i == chunks - 1 else program.needed_kv
        producer: dict[str, int] = {}
        for j in steps:
            step = program.steps[j]
            t = Task(len(tasks), i, j, step.sub.processor)
            for name in step.sub.inputs:
                dep = producer.get(name, producer_prev.get(name))
                if dep is not None and dep not in t.deps:
                    t.deps.append(dep)
            for name in step.sub.outputs:
                producer[name] = t.id
            index[(i, j)] = t.id
            tasks.append(t)
        producer_prev = {}
        for layer, (k, v) in enumerate(zip(program.out_k, program.out_v)):
            producer_prev[past_name("k", layer)] = producer[k]
            producer_prev[past_name("v", layer)] = producer[v]
    for t in tasks:
        for d in t.deps:
            tasks[d].users.append(t.id)
    return tasks
