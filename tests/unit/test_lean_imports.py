"""A rank's libraries leave out the optional packages megarl never uses (megarl.lean_imports):
transformers' tokenizer auto-classes without scikit-learn and SciPy, megatron-core without
Weights & Biases, vLLM's engine without Ray, SciPy, OpenCV and OpenTelemetry; every package
stays importable afterwards. In a fresh interpreter, as a rank starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    from megarl.lean_imports import (
        VLLM_OPTIONAL, import_megatron_lean, import_transformers_lean, packages_hidden
    )

    import_transformers_lean()
    import_megatron_lean()
    from transformers import AutoTokenizer  # noqa: F401  (the auto-classes a rank loads)
    import megatron.core.inference.contexts.dynamic_context as dynamic  # megatron's W&B user
    with packages_hidden(VLLM_OPTIONAL):
        from vllm import LLM  # noqa: F401  (the engine's imports, as VLLMRollout makes them)
    from transformers.utils import import_utils
    from vllm.tracing import otel
    names = ("sklearn", "wandb", "scipy", "ray", "cv2", "opentelemetry", "grpc")
    print("after the libraries:", *(name in sys.modules for name in names))
    print("megatron sees W&B:", dynamic.HAVE_WANDB)
    print("transformers sees SciPy:", import_utils.is_scipy_available())
    print("vLLM sees OpenTelemetry:", otel.is_otel_available())
    import sklearn, wandb, scipy, ray, cv2, opentelemetry  # noqa: F401  (a user's code still can)
    print("importable afterwards:", sklearn.__name__, wandb.__name__, scipy.__name__, ray.__name__,
          cv2.__name__, opentelemetry.__name__)
    with packages_hidden(["json"]):  # an imported package is never hidden
        import json  # noqa: F401
    print("imported stays:", "json" in sys.modules)
    """
)


def test_tokenizers_megatron_and_vllm_import_without_the_packages_they_do_not_need():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "after the libraries: False False False False False False False" in out, out
    assert "megatron sees W&B: False" in out
    assert "transformers sees SciPy: False" in out
    assert "vLLM sees OpenTelemetry: False" in out
    assert "importable afterwards: sklearn wandb scipy ray cv2 opentelemetry" in out
    assert "imported stays: True" in out


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_vllm_imports_lean_first_in_a_process_however_transformers_decided():
    """As a script that builds the engine directly (no megarl entry point before it) imports
    it: first in the process, and after transformers found scikit-learn (its generation
    utilities then import it, which a hidden SciPy broke: "'scipy' is not a package")."""
    first = _fresh(
        """
        from megarl.lean_imports import import_vllm_lean
        import_vllm_lean()
        import sys
        print("hidden:", "ray" in sys.modules, "cv2" in sys.modules)
        """
    )
    assert first.returncode == 0 and "hidden: False False" in first.stdout, first.stderr[-3000:]
    decided = _fresh(
        """
        from transformers.utils import import_utils
        assert import_utils.is_sklearn_available()  # transformers decided before megarl did
        from megarl.lean_imports import import_vllm_lean
        import_vllm_lean()
        print("imported")
        """
    )
    assert decided.returncode == 0 and "imported" in decided.stdout, decided.stderr[-3000:]
