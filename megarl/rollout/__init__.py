"""3D-HybridEngine: the colocated rollout engines and the rollout's own pieces.

The seam the trainer uses is :mod:`megarl.rollout.engine`: ``HybridEngine`` (``to_rollout``,
``generate_from``, ``to_train``) over a ``RolloutEngine``, the protocol every rollout backend
implements (in ``rollout_types``, with the other seam types; ``ROLLOUT_BACKENDS``: vLLM in
``vllm_rollout``, transformers' generate in ``hf_rollout``), built by ``make_rollout``. How a
rollout is split over the engines and put back (``rollout_split``), seeded (``seeds``), and made
by a trajectory source (``trajectory_source``): one reply per sample (``one_reply``), an
environment's turns (``env_source``, with the ``continuous`` and the lock-step ``multi_turn``
loops over the engine calls of ``engine_calls``) or an agent's runs (:mod:`megarl.agents`) lives
here; the weights' plans and their execution (reshard, broadcast) are :mod:`megarl.weights`.
"""
