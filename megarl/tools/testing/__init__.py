"""Test assets: tiny random models and offline tokenizers for tests, benchmarks, ``megarl demo``
and the quickstart. A training run never imports this package."""
