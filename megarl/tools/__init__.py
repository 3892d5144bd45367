"""Tooling beside the runtime: the GPU check, dataset preparation, offline test assets, the demo
and the quickstart. The runtime (everything else under ``megarl/``) never imports this package;
``tests/unit/test_import_structure.py`` holds it to that."""
