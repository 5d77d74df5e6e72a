"""Adapters that plug fagen's attention into other libraries (each imports its library lazily).

* :mod:`fagen.integrations.transformers` -- ``register()`` makes ``attn_implementation="fagen"``
  available to Hugging Face ``transformers`` models.
"""
