"""Integrations of solattn with other libraries, each imported on its own (no import here pulls in
a third-party package):

* :mod:`solattn.integrations.transformers` - the ``"solattn"`` attention backend for Hugging Face
  transformers 5.x (``attn_implementation="solattn"``).
"""
