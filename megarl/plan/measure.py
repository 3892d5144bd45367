"""Peak bytes of live tensor storage in this process, for checking the memory model on CPU.

Why not RSS: a process's resident size also holds the Python and torch libraries, glibc's
free lists and page cache of mapped files, and it lags frees; on a 2-core CPU run those move
by more than the activations being checked. Here every tensor produced by an operator is seen
through a ``TorchDispatchMode``; each distinct storage is counted once (views share it) from the
operator that produced it until its last reference dies (a ``weakref.finalize`` on the storage,
whose Python object torch keeps alive exactly as long as the storage itself).

What this does not see: buffers an operator allocates and frees internally (e.g. inside a gloo
collective or a fused kernel), and tensors created before tracking started: a view of one taken
later counts its whole storage as new. Start tracking before the model is built, or declare what
exists with ``existing(tensors)``.

Needs torch; the rest of :mod:`megarl.plan` does not.
"""

from __future__ import annotations

import weakref


def _make_tracker_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveTensorBytes(TorchDispatchMode):
        """``with LiveTensorBytes() as t: ...``; ``t.live``, ``t.peak``, ``t.phase(name)``."""

        def __init__(self) -> None:
            super().__init__()
            self.live = 0
            self.peak = 0
            self._sizes: dict[int, int] = {}
            self.phases: dict[str, int] = {}
            self.phase_ops: dict[str, str] = {}
            self._phase_op = ""
            self._phase: str | None = None
            self._phase_peak = 0
            self.peak_op = ""
            self._op = ""  # the operator whose outputs set the peak (for debugging a model)

        def _release(self, key: int) -> None:
            self.live -= self._sizes.pop(key, 0)

        def _note(self, tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            key = storage._cdata
            size = storage.nbytes()
            old = self._sizes.get(key)
            if old is None:
                self._sizes[key] = size
                self.live += size
                weakref.finalize(storage, self._release, key)
            elif old != size:  # resized in place (out= variants, resize_)
                self._sizes[key] = size
                self.live += size - old
            if self.live > self.peak:
                self.peak = self.live
                self.peak_op = self._op
            if self.live > self._phase_peak:
                self._phase_peak = self.live
                self._phase_op = self._op

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self._op = str(func)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self._note(t)
            # In-place and out= operators return their target; a resized input shows there too.
            return out

        def existing(self, tensors) -> int:
            """Count ``tensors`` made before tracking began (e.g. a model's parameters) as live
            now: an operator's view of one later (``detach``, ``narrow``) then adds nothing, so
            ``peak`` minus the ``live`` this returns is what was allocated after this call."""
            for t in tensors:
                self._note(t)
            self.peak = self._phase_peak = self.live
            return self.live

        def phase(self, name: str | None) -> None:
            """Close the current phase (recording its peak) and start ``name`` (None: stop)."""
            if self._phase is not None and self._phase_peak >= self.phases.get(self._phase, 0):
                self.phases[self._phase] = self._phase_peak
                self.phase_ops[self._phase] = self._phase_op
            self._phase = name
            self._phase_peak = self.live
            self._phase_op = ""

    return LiveTensorBytes


_CLASS: type | None = None


def live_tensor_tracker():
    """A new tracker (a ``TorchDispatchMode``); enter it with ``with``."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_tracker_class()
    return _CLASS()
