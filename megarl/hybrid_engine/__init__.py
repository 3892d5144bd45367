"""3D-HybridEngine: reshard the actor from megatron's TP x PP layout into a colocated vLLM engine.

``plan`` is pure (no vLLM, no megatron); ``execute`` moves the planned slices over
torch.distributed; ``vllm_rollout`` is the rollout engine seam; ``engine`` holds the transitions.
Import the heavy parts from their modules (``megarl.hybrid_engine.engine.HybridEngine``).
"""

from megarl.hybrid_engine.reshard_plan import ReshardPlan, TensorSpec, plan_reshard
from megarl.hybrid_engine.tensor_list import actor_tensor_specs

__all__ = ["ReshardPlan", "TensorSpec", "actor_tensor_specs", "plan_reshard"]
