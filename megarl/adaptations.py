"""Every change megarl makes to a library's behaviour, from outside the library (site-packages is
never edited): megatron-core's CPU adaptation (:mod:`megarl.platform`), the rope and grad-scaling
swaps, the checkpoint reader, warning filters. ``tests/unit/test_platform.py`` fails on an
adaptation that is not listed here (an assignment to an attribute of a library module, a warning
filter), so a reader finds them all in one table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Adaptation:
    """One change megarl makes to a library's behaviour from outside it (site-packages is never
    edited). ``by`` is the megarl function that makes it (``module:function``; a bare module: its
    import does), ``helpers`` the functions of that module doing the work for it; ``scope`` says
    when it holds: ``process`` (from the call on), ``block`` (inside a ``with``), ``import``."""

    library: str
    changes: str
    by: str
    scope: str
    why: str
    helpers: tuple[str, ...] = ()


ADAPTATIONS: tuple[Adaptation, ...] = (
    Adaptation(
        "megatron-core",
        "torch as ADAPTED_MODULES see it, TENSOR_METHOD_FUNCTIONS, the RNG tracker, MoE helpers",
        "megarl.platform:adapt_megatron_for_cpu",
        "process (CPU only)",
        "megatron-core calls CUDA-only torch APIs",
        ("_cpu_tensor_methods", "_wrap_tensor_methods", "_adapt_rng_tracker", "_adapt_moe"),
    ),
    Adaptation(
        "megatron-core",
        "rope_utils._apply_rotary_pos_emb_bshd (the unfused rope)",
        "megarl.models.rotary:use_cached_rotary",
        "process (at model build)",
        "the same values without per-layer cos/sin recomputation and the closing copy",
    ),
    Adaptation(
        "megatron-core",
        "rope_utils._apply_rotary_pos_emb_bshd back to megatron's own",
        "megarl.models.rotary:megatron_rotary",
        "block",
        "comparisons and parity tests",
    ),
    Adaptation(
        "megatron-core",
        "optimizer.clip_grads.multi_tensor_scale_impl (without apex / TE)",
        "megarl.models.grad_scale:use_in_place_grad_scaling",
        "process (at DDP wrap)",
        "grad clipping without a temporary copy of every grad",
    ),
    Adaptation(
        "megatron-core",
        "optimizer.clip_grads.multi_tensor_scale_impl back to megatron's own",
        "megarl.models.grad_scale:megatron_grad_scaling",
        "block",
        "comparisons",
    ),
    Adaptation(
        "megatron-core",
        "dist_checkpointing torch strategy's _get_filesystem_reader",
        "megarl.checkpoint.safe_load:_safe_readers",
        "block (loading a checkpoint)",
        "checkpoint metadata read through an allow-listed unpickler",
    ),
    Adaptation(
        "megatron-core",
        "dist_checkpointing's filesystem_async._results_queue: an in-process queue",
        "megarl.checkpoint.write_results:in_process_write_results",
        "process (from the first checkpoint save)",
        "its own is a spawned manager process (2-2.5 s of the first save); megarl saves "
        "synchronously, so the queue never leaves the rank",
    ),
    Adaptation(
        "torch",
        "elastic.rendezvous.static_tcp_rendezvous.TCPStore: the agent's store on loopback",
        "megarl.quiet_torchrun:_store_on_loopback",
        "process (megarl's torchrun agent, when the ranks meet at a loopback address)",
        "TCPStore listens on every interface whatever host it is given (megarl.loopback)",
    ),
    Adaptation(
        "ray",
        "_private.ray_constants.ENABLE_RAY_CLUSTER (and its environment variable) off",
        "megarl.cluster.ray_job:_local_on_loopback",
        "process (a local Ray instance)",
        "the local instance takes the loopback address, and its servers listen there only",
    ),
    Adaptation(
        "warnings",
        "megatron-core's CPU-fallback warnings ignored",
        "megarl.platform",
        "import",
        "megatron warns while it is imported, before any call could filter",
    ),
    Adaptation(
        "warnings",
        "console.KNOWN_WARNINGS ignored in a rank",
        "megarl.console:quiet_rank_console",
        "process (rank start, unless verbose)",
        "deprecations nothing in a run can act on",
    ),
    Adaptation(
        "warnings",
        "torch's ShardedTensor deprecations ignored",
        "megarl.checkpoint.store:_quiet_dist_checkpointing",
        "block (save, load)",
        "megatron-core drives torch's deprecated checkpoint API on every call",
    ),
)
