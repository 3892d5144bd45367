"""The actor's weights on their way to a rollout engine: what each rank sends and receives, and
the moves that carry it out.

Planning is pure (no vLLM, no megatron): ``reshard_schedule`` maps megatron's TP x PP (x EP)
shards onto the rollout engines' TP layout, ``tensor_list`` names the tensors a model family
plans, ``broadcast_schedule`` orders the asynchronous mode's trainer-to-rollout broadcast, and
``reshard_mode`` picks how a colocated engine receives its slices. Execution moves them over
torch.distributed: ``execute`` (colocated, in place), ``weight_sync`` (asynchronous, staged in
host memory), with ``weight_shards`` (what an engine is handed), ``lora_merge`` (adapters merged
on the way) and ``hf_saved_names`` (the names a Hugging Face folder saves). The colocated
engine that drives them is :mod:`megarl.rollout.engine`.
"""

from megarl.weights.reshard_schedule import PlannedTensor, ReshardSchedule, schedule_reshard
from megarl.weights.tensor_list import actor_planned_tensors

__all__ = ["PlannedTensor", "ReshardSchedule", "actor_planned_tensors", "schedule_reshard"]
