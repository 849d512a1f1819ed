"""Runnable examples (``PYTHONPATH=. python3 examples/<name>.py``), importable from the repository root as
``examples.<name>`` (the client benchmark imports ``examples.hybrid_prefill``)."""
