"""A rollout engine on Hugging Face transformers' ``generate``: ``rollout.engine.backend=hf``.

The same seam as :class:`megarl.rollout.vllm_rollout.VLLMRollout` (``update_weights`` with
HF-named tensors, ``load_shards`` with the slices of them a TP rank loads, ``generate`` with
per-request seeds returning tokens and logprobs, ``sleep``/``wake_up``) for machines without vLLM
and for debugging: it is much slower than vLLM and each rank holds a whole replica of the model
(an inference-TP group generates the same responses on each of its ranks). In shard-mode
resharding each rank of a group receives its slices only, and the group completes its replicas
with one all-gather per bucket inside the group (consecutive ranks: one node).

Each request (one prompt, ``n`` samples) is generated on its own, unpadded, so its samples do not
depend on the batch; a sampled request draws from a generator seeded with its request seed
(the trainer's RNG state is left untouched). Logprobs are those of the raw model distribution
(before temperature, top-k or top-p), as vLLM reports them and the trainer computes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megarl import platform
from megarl.dtypes import dtype_from_name
from megarl.rollout.engine_folder import check_weight_update, checkpoint_shapes, eos_token_ids
from megarl.rollout.rollout_types import (
    EngineConfig,
    RolloutOutput,
    SamplingConfig,
    request_seed,
)
from megarl.weights.hf_saved_names import saved_tensor_index
from megarl.weights.weight_shards import ShardSlice, WeightShard, check_shards


class HFRollout:
    """transformers ``generate`` over a whole replica of the model on this process's device."""

    backend = "hf"

    def __init__(
        self,
        model_dir: str | Path,
        infer_tp: int = 1,
        config: EngineConfig | None = None,
        expected_shapes: dict[str, tuple[int, ...]] | None = None,
    ):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model_dir = str(model_dir)
        self.config = config or EngineConfig()
        self.infer_tp = infer_tp
        self.device = platform.device()
        self.default_stop = eos_token_ids(model_dir)
        self.expected_shapes = expected_shapes or checkpoint_shapes(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=dtype_from_name(self.config.dtype)
        )
        self.model.to(self.device).eval()
        # The folder's generation defaults (repetition penalty, top-k ...) must not apply: every
        # setting comes from SamplingConfig.
        self.model.generation_config = GenerationConfig()
        self._params = dict(self.model.named_parameters())
        # saved (checkpoint) names the model holds in another layout, e.g. fused MoE experts
        self._saved = (
            saved_tensor_index(self.model)
            if any(n not in self._params for n in self.expected_shapes)
            else {}
        )
        self.group = _rollout_group(infer_tp)
        self.asleep = False
        self.weights_dropped = False
        # actor.router_replay: each router's top-k indices, call by call, while recording
        self._route_calls: list[list[torch.Tensor]] | None = None
        if self.config.record_routes:
            self._route_calls = _record_router_choices(self.model)

    # -- weights -------------------------------------------------------------------------------
    def validate(self, weights: Sequence[tuple[str, torch.Tensor | tuple[int, ...]]]) -> None:
        check_weight_update(self.expected_shapes, weights, self.model_dir)

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the model (validated first: nothing loads on a
        mismatch). A tied LM head follows the embedding it shares storage with."""
        batch = list(weights)
        self.validate(batch)
        for name, tensor in batch:
            if name in self._params:
                self._params[name].copy_(tensor)
            else:
                self._saved[name].write(tensor)

    def validate_shards(self, shards: Sequence[ShardSlice]) -> None:
        check_shards(self.expected_shapes, shards, self.model_dir)

    @torch.no_grad()
    def load_shards(self, shards: Sequence[WeightShard]) -> None:
        """Write this rank's slices, and those of the other ranks of its rollout TP group (one
        all-gather of the bucket), into the model: every rank ends with the whole tensors."""
        batch = list(shards)
        self.validate_shards([spec for spec, _ in batch])
        for spec, tensor in _gather_group(batch, self.group):
            self._write(spec, tensor)

    def _write(self, spec: ShardSlice, tensor: torch.Tensor) -> None:
        if spec.name not in self._params:
            self._saved[spec.name].write(tensor, spec.dim, spec.start)
            return
        target = self._params[spec.name].data
        if spec.dim is not None:
            target = target.narrow(spec.dim, spec.start, tensor.shape[spec.dim])
        target.copy_(tensor)

    def after_weight_update(self) -> None:
        """Nothing computed from the old weights outlives a ``generate`` call here."""

    # -- generation ----------------------------------------------------------------------------
    def _generation_config(self, sampling: SamplingConfig, stop: Sequence[int]):
        from transformers import GenerationConfig

        greedy = sampling.temperature == 0
        return GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy or sampling.top_k <= 0 else sampling.top_k,
            max_new_tokens=sampling.max_new_tokens,
            num_return_sequences=sampling.n,
            eos_token_id=list(stop) or None,
            pad_token_id=stop[0] if stop else 0,
            output_logits=True,
            return_dict_in_generate=True,
        )

    @torch.no_grad()
    def _one_request(self, prompt: list[int], gen_config, seed: int | None, stop: set[int]):
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        if self._route_calls is not None:
            for calls in self._route_calls:
                calls.clear()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, generation_config=gen_config
            )
        new = out.sequences[:, len(prompt) :]
        logprobs = torch.stack(
            [
                torch.log_softmax(step.float(), dim=-1).gather(1, new[:, t : t + 1])[:, 0]
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        )
        rows = []
        for j, (tokens, lps) in enumerate(zip(new.tolist(), logprobs.tolist(), strict=True)):
            end = next((k + 1 for k, tok in enumerate(tokens) if tok in stop), None)
            reason = "length" if end is None else "stop"
            end = len(tokens) if end is None else end
            routes = None
            if self._route_calls is not None:
                routes = _sample_routes(self._route_calls, j, len(new), len(prompt), end)
            rows.append((tokens[:end], lps[:end], reason, routes))
        return rows

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed_offset: int = 0,
        *,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> RolloutOutput:
        """``sampling.n`` responses per prompt; request i is seeded with ``seeds[i]`` when given,
        else as :func:`~megarl.rollout.rollout_types.request_seed` says, and gets
        ``max_new_tokens[i]`` new tokens at most when given."""
        if self.asleep:
            raise RuntimeError("the rollout engine is asleep; call wake_up() first")
        stop = tuple(
            sampling.stop_token_ids if sampling.stop_token_ids is not None else self.default_stop
        )
        gen_config = self._generation_config(sampling, stop)
        greedy = sampling.temperature == 0
        out = RolloutOutput()
        for i, prompt in enumerate(prompt_token_ids):
            seed = None if greedy else request_seed(sampling, seed_offset, i, seeds)
            config = gen_config
            if max_new_tokens is not None:
                config = self._generation_config(
                    replace(sampling, max_new_tokens=int(max_new_tokens[i])), stop
                )
            for tokens, lps, reason, routes in self._one_request(
                list(map(int, prompt)), config, seed, set(stop)
            ):
                out.prompt_index.append(i)
                out.token_ids.append(tokens)
                out.logprobs.append(lps)
                out.finish_reasons.append(reason)
                if routes is not None:
                    out.routes.append(routes)
        return out

    # -- memory --------------------------------------------------------------------------------
    def sleep(self) -> None:
        """GPU: ``sleep_level`` 2 drops the weights (the next reshard refills every one), 1
        moves them to host memory; the KV cache lives only inside a ``generate`` call. CPU:
        nothing to free."""
        if self.device.type == "cuda" and not self.asleep:
            if self.config.sleep_level == 2:
                drop_parameters(self.model)
                self.weights_dropped = True
            else:
                self.model.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """GPU: the weights come back with ``tags`` None or containing ``"weights"`` (after
        ``sleep_level`` 2 as uninitialised memory, for the reshard to fill)."""
        if self.device.type == "cuda" and (tags is None or "weights" in tags):
            if self.weights_dropped:
                restore_parameters(self.model)
                self.weights_dropped = False
            else:
                self.model.to(self.device)
        if tags is None or "kv_cache" in tags:
            self.asleep = False


def _record_router_choices(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """Forward hooks on the model's MoE routers (transformers' ``*TopKRouter`` modules, which
    return ``(logits, weights, indices)``), in layer order: each call's ``[tokens, top_k]``
    indices appended to that router's list (int16, host)."""
    calls: list[list[torch.Tensor]] = []
    for module in model.modules():
        if not type(module).__name__.endswith("TopKRouter"):
            continue
        mine: list[torch.Tensor] = []
        calls.append(mine)

        def hook(_module, _args, output, mine=mine):
            mine.append(output[2].detach().to("cpu", torch.int16))

        module.register_forward_hook(hook)
    if not calls:
        raise ValueError(
            "actor.router_replay: the rollout model has no MoE router (a transformers "
            "*TopKRouter module) to record"
        )
    return calls


def _sample_routes(
    calls: list[list[torch.Tensor]], row: int, rows: int, prompt_len: int, length: int
) -> torch.Tensor:
    """Row ``row``'s routes of one ``generate`` (``rows`` samples of one prompt), ``[prompt_len +
    length, layers, top_k]``: the prompt's from the prefill (one row of ``prompt_len`` tokens,
    or ``rows`` of them when generate expanded the prompt first), then each response token's from
    the decode step that read it; the last token, never read, routed by no one (-1)."""
    per_layer = []
    for layer in calls:
        prefill = layer[0]
        start = row * prompt_len if prefill.shape[0] == rows * prompt_len else 0
        prompt = prefill[start : start + prompt_len]
        steps = [step[row : row + 1] for step in layer[1:length]]
        last = torch.full((1, prompt.shape[1]), -1, dtype=torch.int16, device="cpu")
        per_layer.append(torch.cat([prompt, *steps, last]))
    return torch.stack(per_layer, dim=1)


def drop_parameters(model: torch.nn.Module) -> None:
    """Free the memory of every parameter: its storage shrinks to nothing (shapes, dtypes and
    tying kept; buffers untouched)."""
    for param in model.parameters():  # a tied parameter is listed once
        param.data.untyped_storage().resize_(0)


def restore_parameters(model: torch.nn.Module) -> None:
    """Give every parameter dropped by :func:`drop_parameters` its memory back, uninitialised."""
    for param in model.parameters():
        storage = param.data.untyped_storage()
        if storage.nbytes() == 0 and param.numel():
            storage.resize_(param.numel() * param.element_size())


def _rollout_group(infer_tp: int):
    """This rank's rollout TP group (consecutive ranks), made collectively by every rank; None
    when the group is this rank alone."""
    if infer_tp == 1 or not dist.is_initialized():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = None
    for first in range(0, world, infer_tp):
        ranks = list(range(first, first + infer_tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _gather_group(batch: list[WeightShard], group) -> list[WeightShard]:
    """Every rank's slices of one bucket, for every rank of ``group``: the slice specs by
    ``all_gather_object``, the data in one flat ``all_gather`` (padded to the longest)."""
    if group is None:
        return batch
    specs: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(specs, [spec for spec, _ in batch], group=group)
    # every rank of the group has a slice (maybe empty) of each tensor of the bucket
    flat = torch.cat([t.reshape(-1) for _, t in batch])
    sizes = [sum(math.prod(s.shape) for s in rank_specs) for rank_specs in specs]
    buf = torch.zeros(max(sizes), dtype=flat.dtype, device=platform.collective_device(group))
    buf[: flat.numel()].copy_(flat)
    gathered = [torch.empty_like(buf) for _ in specs]
    dist.all_gather(gathered, buf, group=group)
    out = []
    for rank_specs, data in zip(specs, gathered, strict=True):
        offset = 0
        for spec in rank_specs:
            n = math.prod(spec.shape)
            out.append((spec, data[offset : offset + n].view(spec.shape)))
            offset += n
    return out
