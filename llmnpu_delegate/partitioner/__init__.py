"""Partition stage: FX graph analysis, NPU/CPU region tagging, and the ExecuTorch Partitioner.

``regions`` holds the core pass over any FX ``GraphModule``; ``executorch`` wraps it as an
ExecuTorch ``Partitioner``; ``report`` summarises a partition (sharing, FLOPs, memory).
"""
from .regions import Partition, Subgraph, partition_graph, subgraph_module  # noqa: F401
