"""verl's config keys and megarl's for the same setting, for users who bring verl's habits.

An unknown setting that is one of verl's gets "did you mean" with megarl's key; ``docs/verl_keys.md``
holds the same table (``tests/unit/test_verl_keys.py`` keeps the two equal and checks that every
megarl key named here is a real one). Keys both projects spell the same (``data.train_files``,
``algorithm.adv_estimator``, ``trainer.save_freq``, ...) are not listed: they just work.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerlKey:
    """megarl's key for a verl key (None: no setting, the note says how megarl does it)."""

    megarl: str | None
    note: str = ""


_A, _R, _M = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model."
_SHARED_MICRO = "megarl's micro-batch size (sequences per rank) serves every model"

VERL_KEYS: dict[str, VerlKey] = {
    # the model
    f"{_M}path": VerlKey("model.path"),
    f"{_M}enable_gradient_checkpointing": VerlKey("model.recompute", "full | selective | none"),
    f"{_M}use_remove_padding": VerlKey("actor.packing"),
    f"{_M}lora_rank": VerlKey("actor.lora.rank"),
    f"{_M}lora_alpha": VerlKey("actor.lora.alpha"),
    f"{_M}target_modules": VerlKey("actor.lora.target_modules"),
    "critic.model.path": VerlKey("model.critic_path"),
    # the actor's update
    f"{_A}ppo_mini_batch_size": VerlKey("actor.ppo_mini_batch_size"),
    f"{_A}ppo_micro_batch_size_per_gpu": VerlKey("actor.micro_batch_size"),
    f"{_A}ppo_micro_batch_size": VerlKey("actor.micro_batch_size", "sequences per rank"),
    f"{_A}use_dynamic_bsz": VerlKey(
        "actor.max_tokens_per_micro_batch", "a token budget per micro-batch turns it on"
    ),
    f"{_A}ppo_max_token_len_per_gpu": VerlKey("actor.max_tokens_per_micro_batch"),
    f"{_A}ppo_epochs": VerlKey("actor.ppo_epochs"),
    f"{_A}clip_ratio": VerlKey(
        "algorithm.clip_ratio_low", "both bounds: algorithm.clip_ratio_low and clip_ratio_high"
    ),
    f"{_A}clip_ratio_low": VerlKey("algorithm.clip_ratio_low"),
    f"{_A}clip_ratio_high": VerlKey("algorithm.clip_ratio_high"),
    f"{_A}clip_ratio_c": VerlKey("algorithm.clip_ratio_c"),
    f"{_A}loss_agg_mode": VerlKey("algorithm.loss_agg_mode"),
    f"{_A}policy_loss.loss_mode": VerlKey("algorithm.policy_loss"),
    f"{_A}entropy_coeff": VerlKey("algorithm.entropy_coef"),
    f"{_A}use_kl_loss": VerlKey("algorithm.use_kl_loss"),
    f"{_A}kl_loss_coef": VerlKey("algorithm.kl_loss_coef"),
    f"{_A}kl_loss_type": VerlKey("algorithm.kl_loss_estimator"),
    f"{_A}grad_clip": VerlKey("actor.optim.clip_grad"),
    f"{_A}optim.lr": VerlKey("actor.optim.lr"),
    f"{_A}optim.weight_decay": VerlKey("actor.optim.weight_decay"),
    f"{_A}optim.clip_grad": VerlKey("actor.optim.clip_grad"),
    f"{_A}optim.lr_warmup_steps": VerlKey("actor.optim.warmup_steps"),
    f"{_A}optim.min_lr_ratio": VerlKey("actor.optim.min_lr", "an absolute learning rate"),
    f"{_A}optim.warmup_style": VerlKey("actor.optim.lr_decay_style"),
    f"{_A}optim.lr_scheduler_type": VerlKey("actor.optim.lr_decay_style"),
    # parallelism and memory (megatron backend)
    f"{_A}megatron.tensor_model_parallel_size": VerlKey("parallel.tp"),
    f"{_A}megatron.pipeline_model_parallel_size": VerlKey("parallel.pp"),
    f"{_A}megatron.expert_model_parallel_size": VerlKey("parallel.ep"),
    f"{_A}megatron.context_parallel_size": VerlKey("parallel.cp"),
    f"{_A}megatron.sequence_parallel": VerlKey("parallel.sequence_parallel"),
    f"{_A}megatron.param_offload": VerlKey("actor.param_offload"),
    f"{_A}megatron.grad_offload": VerlKey(
        "actor.param_offload", "weights, grads and optimizer states move together"
    ),
    f"{_A}megatron.optimizer_offload": VerlKey("actor.optimizer_offload", "a share in [0, 1]"),
    "actor_rollout_ref.ref.megatron.param_offload": VerlKey("ref.param_offload"),
    "actor_rollout_ref.ref.fsdp_config.param_offload": VerlKey("ref.param_offload"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": VerlKey(
        "actor.micro_batch_size", _SHARED_MICRO
    ),
    "critic.megatron.param_offload": VerlKey("critic.param_offload"),
    "critic.ppo_micro_batch_size_per_gpu": VerlKey("actor.micro_batch_size", _SHARED_MICRO),
    "critic.ppo_mini_batch_size": VerlKey(
        "actor.ppo_mini_batch_size", "the critic updates on the actor's mini-batches"
    ),
    # the rollout
    f"{_R}name": VerlKey("rollout.engine.backend", "vllm | hf"),
    f"{_R}n": VerlKey("rollout.sampling.n"),
    f"{_R}temperature": VerlKey("rollout.sampling.temperature"),
    f"{_R}top_p": VerlKey("rollout.sampling.top_p"),
    f"{_R}top_k": VerlKey("rollout.sampling.top_k"),
    f"{_R}dtype": VerlKey("rollout.engine.dtype"),
    f"{_R}response_length": VerlKey("rollout.sampling.max_response_length"),
    f"{_R}prompt_length": VerlKey("data.max_prompt_length"),
    f"{_R}gpu_memory_utilization": VerlKey("rollout.engine.gpu_memory_utilization"),
    f"{_R}tensor_model_parallel_size": VerlKey("parallel.infer_tp"),
    f"{_R}log_prob_micro_batch_size_per_gpu": VerlKey("actor.micro_batch_size", _SHARED_MICRO),
    f"{_R}free_cache_engine": VerlKey(
        "rollout.engine.sleep_level", "the engine always sleeps between rollouts; this picks how"
    ),
    f"{_R}val_kwargs.temperature": VerlKey("rollout.sampling.val_temperature"),
    f"{_R}val_kwargs.n": VerlKey("rollout.sampling.val_n"),
    f"{_R}val_kwargs.do_sample": VerlKey("rollout.sampling.val_temperature", "0 is greedy"),
    # data
    "data.max_response_length": VerlKey("rollout.sampling.max_response_length"),
    "data.filter_overlong_prompts": VerlKey("data.overlong_prompts", "filter | error"),
    "data.truncation": VerlKey("data.overlong_prompts", "filter | error"),
    "data.prompt_key": VerlKey(None, "the prompt column is always `prompt` (verl's schema)"),
    # rewards
    "custom_reward_function.path": VerlKey(
        "reward.custom_fn", "one setting: reward.custom_fn=PATH.py:FUNCTION"
    ),
    "custom_reward_function.name": VerlKey(
        "reward.custom_fn", "one setting: reward.custom_fn=PATH.py:FUNCTION"
    ),
    "reward_model.enable": VerlKey("reward.model_path", "setting a path turns it on"),
    "reward_model.model.path": VerlKey("reward.model_path"),
    "reward_model.reward_manager": VerlKey(
        None, "scorers are chosen by each prompt's data_source, or reward.custom_fn for all"
    ),
    "reward_model.overlong_buffer.enable": VerlKey(
        "reward.overlong_buffer.len", "a length > 0 turns it on"
    ),
    "reward_model.overlong_buffer.len": VerlKey("reward.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": VerlKey("reward.overlong_buffer.penalty_factor"),
    # the algorithm
    "algorithm.norm_adv_by_std_in_grpo": VerlKey("algorithm.norm_adv_by_std"),
    "algorithm.kl_penalty": VerlKey("algorithm.kl_in_reward_estimator"),
    "algorithm.kl_ctrl.type": VerlKey("algorithm.kl_ctrl"),
    "algorithm.kl_ctrl.kl_coef": VerlKey("algorithm.kl_coef"),
    "algorithm.kl_ctrl.target_kl": VerlKey("algorithm.target_kl"),
    "algorithm.kl_ctrl.horizon": VerlKey("algorithm.kl_horizon"),
    "algorithm.filter_groups.enable": VerlKey("algorithm.filter_groups"),
    "algorithm.filter_groups.max_num_gen_batches": VerlKey("algorithm.filter_groups_max_batches"),
    "algorithm.filter_groups.metric": VerlKey(None, "groups are filtered on the sample score"),
    # the trainer
    "trainer.total_training_steps": VerlKey("trainer.total_steps"),
    "trainer.total_epochs": VerlKey("trainer.total_steps", "megarl counts steps, not epochs"),
    "trainer.project_name": VerlKey("trainer.experiment"),
    "trainer.experiment_name": VerlKey("trainer.run_name"),
    "trainer.logger": VerlKey("trainer.loggers"),
    "trainer.default_local_dir": VerlKey("trainer.output_dir"),
    "trainer.resume_mode": VerlKey("trainer.resume", "auto | never (verl's disable)"),
    "trainer.resume_from_path": VerlKey(
        "trainer.output_dir", "a run resumes from its own OUTPUT/checkpoints"
    ),
    "trainer.max_actor_ckpt_to_keep": VerlKey("trainer.keep_last"),
    "trainer.max_critic_ckpt_to_keep": VerlKey("trainer.keep_last"),
    "trainer.balance_batch": VerlKey("actor.balance_dp_tokens"),
    "trainer.n_gpus_per_node": VerlKey(None, "`megarl train CONFIG --nproc-per-node N`"),
    "trainer.nnodes": VerlKey(None, "start one `megarl train` per node with torchrun or srun"),
}

VERL_SECTIONS = ("actor_rollout_ref", "custom_reward_function")

# Settings both projects spell the same where verl's -1 means "never": megarl's word for it is 0
# (trainer.save_freq=0 still saves the final checkpoint, which the export is made from).
VERL_NEVER = ("trainer.save_freq", "trainer.test_freq")


def translate_verl_values(tree: dict[str, object]) -> None:
    """verl's -1 (never) in a config layer's :data:`VERL_NEVER` settings becomes 0, in place."""
    for key in VERL_NEVER:
        section, name = key.split(".")
        node = tree.get(section)
        if isinstance(node, dict) and node.get(name) in (-1, "-1"):
            node[name] = 0


def verl_hint(key: str) -> str | None:
    """ "did you mean" text for a verl key (None: not one of verl's)."""
    entry = VERL_KEYS.get(key)
    if entry is not None:
        if entry.megarl is None:
            return f"{key!r} is verl's; megarl has no such setting: {entry.note}"
        note = f" ({entry.note})" if entry.note else ""
        return f"{key!r} is verl's name; did you mean {entry.megarl}{note}?"
    if key.split(".", 1)[0] in VERL_SECTIONS:
        return (
            f"{key!r} is in one of verl's sections, which megarl splits into model.*, actor.*, "
            "rollout.*, ref.*, reward.* (docs/verl_keys.md maps verl's keys)"
        )
    return None
