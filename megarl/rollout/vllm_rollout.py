"""The rollout engine: one vLLM engine per inference-TP group, inside the training processes.

``rollout.engine.backend=hf`` swaps in :class:`megarl.rollout.hf_rollout.HFRollout` behind the
same seam. The seam to the trainer is narrow: :meth:`VLLMRollout.update_weights` (HF-named tensors),
:meth:`VLLMRollout.generate` (token ids in; response ids, per-token logprobs and finish reasons
out), :meth:`VLLMRollout.sleep` / :meth:`VLLMRollout.wake_up`.

Under torch.distributed the engine uses vLLM's ``external_launcher`` executor: vLLM builds its
own TP groups of consecutive ranks over the already initialised world (``world / infer_tp``
independent engines). In-place weight updates go through the worker's ``reload_weights``, on CPU
and CUDA alike: with whole HF tensors (:meth:`VLLMRollout.update_weights`, vLLM cuts its own TP
slice) or with the slices this TP rank loads (:meth:`VLLMRollout.load_shards`, shard-mode
resharding). Sleep mode does not exist on CPU, so ``sleep``/``wake_up`` are no-ops there. An
engine started with ``load_format="dummy"`` holds random weights until the first update.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.checkpoint.hf_assets import has_tokenizer
from megarl.console import is_verbose
from megarl.lean_imports import import_vllm_lean
from megarl.rollout.engine_calls import Request, Sampled
from megarl.rollout.engine_folder import check_weight_update, checkpoint_shapes, eos_token_ids
from megarl.rollout.rollout_types import (
    EngineConfig,
    RolloutOutput,
    SamplingConfig,
    request_seed,
)
from megarl.shm_segments import (
    RUN_SEGMENTS_ENV,
    name_cpu_shm_segments_per_run,
    new_segment_prefix,
)
from megarl.startup_heap import CollectionPaused, freeze_startup_heap
from megarl.weights.weight_shards import ShardSlice, WeightShard, check_shards


@contextlib.contextmanager
def _quiet_reload_logs():
    """Per-bucket reloads leave the other layers untouched on purpose; vLLM warns about each."""
    names = (
        "vllm.model_executor.model_loader.reload.layerwise",
        "vllm.model_executor.model_loader.reload.inplace",
    )
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


class VLLMRollout:
    """A vLLM engine over this rank's inference-TP group (or the whole process when alone)."""

    backend = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        infer_tp: int = 1,
        config: EngineConfig | None = None,
        expected_shapes: dict[str, tuple[int, ...]] | None = None,
    ):

        self.model_dir = str(model_dir)
        self.config = config or EngineConfig()
        self.infer_tp = infer_tp
        self.cuda = torch.cuda.is_available()
        self.default_stop = eos_token_ids(model_dir)
        self.expected_shapes = expected_shapes or checkpoint_shapes(model_dir)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # Without OMP_NUM_THREADS vLLM's CPU worker drops to one thread: keep the trainer's count.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        kwargs = dict(
            model=self.model_dir,
            dtype=self.config.dtype,
            max_model_len=self.config.max_model_len,
            enforce_eager=not self.cuda,
            seed=self.config.seed,
            tensor_parallel_size=infer_tp,
            skip_tokenizer_init=not has_tokenizer(model_dir),
            max_num_seqs=self.config.max_num_seqs,
            use_tqdm_on_load=is_verbose(),  # the weight-loading bar, hidden on a quiet console
            # logprobs of the distribution sampled from (after temperature, top-k, top-p), which
            # the trainer reproduces (logits / temperature); raw ones would be the untempered model
            logprobs_mode="processed_logprobs",
            load_format=self.config.load_format,
        )
        if not self.cuda:
            # A prompt prefilled in chunks has its first sampled token discarded, and vLLM then
            # rewinds the request's seeded generator, which a CPU generator cannot do ("CPU
            # Generator does not use offset"). A token budget that fits every scheduled prompt
            # whole avoids partial prefills.
            kwargs["max_num_batched_tokens"] = self.config.max_model_len * self.config.max_num_seqs
        if dist.is_initialized() and dist.get_world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            if not self.cuda:
                # the launcher's prefix (it removes the job's segments); else rank 0's own
                ident = [os.environ.get(RUN_SEGMENTS_ENV) or new_segment_prefix()]
                dist.broadcast_object_list(ident, src=0)
                name_cpu_shm_segments_per_run(ident[0])
        if self.cuda:
            kwargs.update(
                enable_sleep_mode=True, gpu_memory_utilization=self.config.gpu_memory_utilization
            )
        elif "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kwargs["kv_cache_memory_bytes"] = self.config.kv_cache_bytes
        # vLLM reseeds the global RNGs (megatron's CPU RNG tracker lives on the CPU generator) and
        # replaces torch.set_num_threads on CPU: keep the trainer's state as it was.
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.cuda else None
        threads = torch.get_num_threads()
        try:
            # The engine's imports (megarl.lean_imports) and start without automatic garbage
            # collection (megarl.startup_heap); vLLM's modules are frozen once imported, which
            # leaves them out of the engine's own collections (two, before it freezes the heap).
            with CollectionPaused():
                import_vllm_lean()
                from vllm import LLM

                freeze_startup_heap()
                self.llm = LLM(**kwargs)
        finally:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.asleep = False
        self.weights_loaded = self.config.load_format != "dummy"

    # -- weights -------------------------------------------------------------------------------
    def validate(self, weights: Sequence[tuple[str, torch.Tensor | tuple[int, ...]]]) -> None:
        check_weight_update(self.expected_shapes, weights, self.model_dir)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors in place (validated first: nothing loads on a mismatch).

        Every vLLM module must get all its tensors in one call (q, k and v together; gate and up
        together; every expert of a fused MoE layer), or vLLM's reload processes it half loaded:
        the reshard schedule's buckets hold whole layers
        (:func:`megarl.weights.tensor_list.update_group`).
        """
        batch = list(weights)
        self.validate(batch)
        with _quiet_reload_logs():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": batch})

    def validate_shards(self, shards: Sequence[ShardSlice]) -> None:
        check_shards(self.expected_shapes, shards, self.model_dir)

    def load_shards(self, shards: Sequence[WeightShard]) -> None:
        """Load the slices this TP rank holds of HF-named tensors in place (validated first).

        vLLM's loaders cut a TP slice from a whole tensor; here they are told the slice is
        already cut (:func:`_load_presharded`). As with :meth:`update_weights`, every vLLM layer
        must get all its tensors in one call.
        """
        batch = list(shards)
        self.validate_shards([spec for spec, _ in batch])
        with _quiet_reload_logs():
            self.llm.collective_rpc(_load_presharded, args=([(spec.name, t) for spec, t in batch],))

    def after_weight_update(self) -> None:
        """Call once all buckets are loaded: nothing computed from the old weights may survive.

        - vLLM's prefix cache holds prompt KV computed with the old weights;
        - vLLM's CPU backend multiplies by the LM head through a oneDNN handle that holds its own
          packed copy of the weight, which ``reload_weights`` does not rebuild (measured: logprobs
          off by up to 0.9 after an embedding update, 1e-6 after rebuilding it).
        """
        if not self.cuda:
            self.llm.collective_rpc(_rebuild_cpu_lm_head)
        self.llm.reset_prefix_cache()
        self.weights_loaded = True

    # -- generation ----------------------------------------------------------------------------
    def sampling_params(
        self, sampling: SamplingConfig, seed: int | None, max_tokens: int | None = None
    ):
        from vllm import SamplingParams

        stop = sampling.stop_token_ids
        if stop is None:
            stop = self.default_stop
        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=sampling.max_new_tokens if max_tokens is None else max_tokens,
            stop_token_ids=list(stop),
            seed=seed,
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            detokenize=False,
        )

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed_offset: int = 0,
        *,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> RolloutOutput:
        """``sampling.n`` responses per prompt; request i is seeded with ``seeds[i]`` when given
        (its sample j with ``seeds[i] + j``), else as :func:`request_seed` says, and gets
        ``max_new_tokens[i]`` new tokens at most when given (one call for a turn of many
        trajectories, each with its own budget)."""
        self._check_ready()
        prompts = [{"prompt_token_ids": list(map(int, p))} for p in prompt_token_ids]
        seeded = _seeded(sampling)
        params = [
            self.sampling_params(
                sampling,
                request_seed(sampling, seed_offset, i, seeds) if seeded else None,
                None if max_new_tokens is None else int(max_new_tokens[i]),
            )
            for i in range(len(prompts))
        ]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        out = RolloutOutput()
        for i, res in enumerate(results):
            for completion in res.outputs:
                ids, lps = _ids_and_logprobs(completion)
                out.prompt_index.append(i)
                out.token_ids.append(ids)
                out.logprobs.append(lps)
                out.finish_reasons.append(str(completion.finish_reason))
        return out

    def _check_ready(self) -> None:
        if self.asleep:
            raise RuntimeError("the rollout engine is asleep; call wake_up() first")
        if not self.weights_loaded:
            raise RuntimeError(
                "the rollout engine still holds its start-up dummy weights: load the actor's "
                "(the hybrid engine's to_rollout) before generating"
            )

    # -- step by step (megarl.rollout.step_loop) --------------------------------------------
    def add_requests(
        self, requests: Sequence[tuple[str, Request]], sampling: SamplingConfig
    ) -> None:
        """Queue each ``(id, request)`` for the engine's next :meth:`step`: one response each,
        seeded and limited as :meth:`generate` seeds and limits a request."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        self._check_ready()
        seeded = _seeded(sampling)
        prompts = self.llm.renderer.render_cmpl(
            [
                parse_model_prompt(
                    self.llm.model_config, {"prompt_token_ids": list(map(int, r.prompt_ids))}
                )
                for _, r in requests
            ]
        )
        for (key, request), prompt in zip(requests, prompts, strict=True):
            params = self.sampling_params(
                replace(sampling, n=1), request.seed if seeded else None, request.max_new_tokens
            )
            params.output_kind = RequestOutputKind.FINAL_ONLY  # no partial outputs to process
            self.llm.llm_engine.add_request(key, prompt, params)

    def step(self) -> list[tuple[str, Sampled]]:
        """One step of vLLM's engine (one forward of every running request); the requests it
        finished, by the ids they were added with."""
        out = []
        for result in self.llm.llm_engine.step():
            if result.finished:
                completion = result.outputs[0]
                ids, lps = _ids_and_logprobs(completion)
                out.append((result.request_id, Sampled(ids, lps, str(completion.finish_reason))))
        return out

    # -- memory --------------------------------------------------------------------------------
    def sleep(self) -> None:
        """GPU: free the KV cache and the weights' GPU memory (``sleep_level`` 2 drops them: the
        next reshard reloads every tensor; 1 copies them to host memory first). CPU: no-op
        (vLLM's CPU build has no sleep mode)."""
        if self.cuda and not self.asleep:
            self.llm.sleep(level=self.config.sleep_level)
        self.asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """GPU: bring back ``tags`` (``["weights"]`` first, then ``["kv_cache"]``). CPU: no-op."""
        if self.cuda:
            self.llm.wake_up(tags=list(tags) if tags else None)
        if tags is None or "kv_cache" in tags:
            self.asleep = False


def _seeded(sampling: SamplingConfig) -> bool:
    """Each request gets its own seed (greedy decoding needs none)."""
    return sampling.temperature != 0 and sampling.per_request_seeds


def _ids_and_logprobs(completion) -> tuple[list[int], list[float]]:
    """A vLLM completion's sampled ids and the logprob of each."""
    ids = list(completion.token_ids)
    lps = [
        float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [], strict=False)
    ]
    return ids, lps


def _load_presharded(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs in vLLM's worker: load this TP rank's slices of HF-named tensors.

    Linear layers go through vLLM's own in-place reload (``reload_weights``: the layer is rebuilt
    in checkpoint format, loaded, and processed again, e.g. repacked for the CPU's GEMM kernels)
    with their loaders told the slice is cut already (:func:`_loaders_take_slices`). A vocabulary
    embedding's loader only takes the whole vocabulary, so its slice is copied into the weight
    directly (its padding rows zeroed, as the loader does); its weight is kept as is after
    loading on every platform (the CPU's LM-head GEMM handle is rebuilt after the update).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.get_model()
    vocab, rest = [], []
    for name, tensor in weights:
        module = _owner_module(model, name)
        if isinstance(module, VocabParallelEmbedding):
            vocab.append((name, module, tensor))
        else:
            rest.append((name, tensor))
    if rest:
        with _loaders_take_slices(model):
            worker.reload_weights(weights_iterator=rest)
    for name, module, tensor in vocab:
        index = module.shard_indices
        rows = index.org_vocab_end_index - index.org_vocab_start_index
        if tensor.shape[0] != rows:
            raise ValueError(
                f"{name}: a slice of {tensor.shape[0]} rows for vLLM's TP rank that holds "
                f"vocabulary rows [{index.org_vocab_start_index}, {index.org_vocab_end_index})"
            )
        with torch.no_grad():
            module.weight.data[:rows].copy_(tensor)
            module.weight.data[rows:].zero_()


def _owner_module(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        return None


@contextlib.contextmanager
def _loaders_take_slices(model: torch.nn.Module):
    """While loading, vLLM's linear-layer loaders take a tensor as the slice for their TP rank.

    vLLM 0.32's linear loaders narrow what they are given to their TP rank's slice: the v2
    loaders of its weight parameters at ``param.tp_rank * shard_size`` (``parameter.py``), the
    v1 loaders of plain parameters (biases) unless ``param.is_sharded_weight``
    (``layers/linear.py``). Rank 0 and ``is_sharded_weight`` make both take the whole slice. The
    in-place reload loads into parameters rebuilt from the metadata recorded at start-up
    (``reload/layerwise.py``), so that metadata is marked too; everything is put back after.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    marked: list[tuple[torch.Tensor, dict]] = []
    for module in model.modules():
        if not isinstance(module, LinearBase):
            continue
        recorded = list(get_layerwise_info(module).restore_metadata[0].values())
        for param in recorded + list(module.parameters(recurse=False)):
            saved = {
                k: param.__dict__[k]
                for k in ("tp_rank", "is_sharded_weight")
                if k in param.__dict__
            }
            marked.append((param, saved))
            param.is_sharded_weight = True
            if "tp_rank" in param.__dict__:
                param.tp_rank = 0
    try:
        yield
    finally:
        for param, saved in marked:
            param.__dict__.pop("is_sharded_weight", None)
            param.__dict__.update(saved)


def _rebuild_cpu_lm_head(worker) -> None:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear") and head.weight.numel() > 0:
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
