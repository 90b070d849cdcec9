"""Fisher pruning inside other libraries' training loops.

Each integration lives in its own module and is imported only by whoever asks for it
(``fisherprune.integrations.hf`` needs ``transformers``, ``fisherprune.integrations.lightning``
needs ``lightning``); importing this package imports neither.
"""
