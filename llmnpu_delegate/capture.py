"""Deprecated: the captured chunk step is ``llmnpu_delegate.chunk_step`` now; these re-exports go in 0.3."""
from .chunk_step import ChunkStep, KVShape, example_inputs, export_chunk_step, kv_shape, max_context  # noqa: F401
