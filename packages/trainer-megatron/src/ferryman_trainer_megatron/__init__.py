"""ferryman's Megatron-core trainer backend (``trainer: {type: megatron}``).

Nothing here imports Megatron: :mod:`.config`, :mod:`.mapping`, :mod:`.convert` and
:mod:`.vocab_parallel` are plain Python / torch; :mod:`.trainer` imports ``megatron.core`` only
when a backend is built.
"""
