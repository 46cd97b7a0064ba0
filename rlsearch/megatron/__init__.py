"""The Megatron layer, under the actor and the checkpoint converter: model building from HuggingFace through mbridge
(model.py), parallel state and sharded state dicts (parallel.py), the CPU compatibility patches for megatron-core
(cpu_compat.py), the owned packed attention (attention.py, with the row layouts of layout.py), and the optimizer,
RNG and distributed-checkpoint state of a training rank (training.py), and rank processes without Ray (processes.py:
on CPU forked from a server that has made the imports of rank_imports.py once).

Nothing here but rank_imports.py imports megatron-core at import time: the modules are imported by the processes that
build models."""
