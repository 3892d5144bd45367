"""3D-HybridEngine: reshard the actor from megatron's TP x PP layout into a colocated rollout engine.

The seam the trainer uses is :mod:`megarl.hybrid_engine.engine`: ``HybridEngine`` (``to_rollout``,
``generate``, ``to_train``) over a ``RolloutEngine``, the protocol every rollout backend implements
(``ROLLOUT_BACKENDS``: vLLM in ``vllm_rollout``, transformers' generate in ``hf_rollout``), built
by ``make_rollout``. Below it, ``reshard_schedule`` is pure (no vLLM, no megatron) and ``execute``
moves the planned slices over torch.distributed. This package exports only the pure planning
names; import the engine from its module (``megarl.hybrid_engine.engine.HybridEngine``).
"""

from megarl.hybrid_engine.reshard_schedule import PlannedTensor, ReshardSchedule, schedule_reshard
from megarl.hybrid_engine.tensor_list import actor_planned_tensors

__all__ = ["PlannedTensor", "ReshardSchedule", "actor_planned_tensors", "schedule_reshard"]
