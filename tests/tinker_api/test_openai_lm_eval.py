"""lm-eval's ``local-completions`` model runs a multiple-choice task (loglikelihood requests:
``echo`` with ``logprobs``, one token generated) against a live server, on a LoRA job's
policy and on its base model, and gets the loglikelihoods, greediness and accuracy that the
same adapter loaded by peft computes in-process.

The task is a YAML of lm-eval's own format over a local JSONL file (nothing downloaded); lm-eval
tokenizes with the base model's tokenizer from its local directory and sends token ids, as
it does against vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

from tests.tinker_api.conftest import BASE_NAME
from tests.tinker_api.test_openai_live import lora_job, server

__all__ = ["lora_job", "server"]  # fixtures, imported for their use here

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TASK = """
task: opentinker_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def rows() -> list[dict[str, Any]]:
    out = []
    for i in range(8):
        a, b = 3 + i, 4 + 2 * i
        right = a + b
        choices = [str(right + d) for d in (0, 1, -1, 10)]
        # The right answer at a different place each time.
        k = i % 4
        choices[0], choices[k] = choices[k], choices[0]
        out.append({"question": f"{a}+{b}=", "choices": choices, "answer": k})
    return out


def reference(model: Any, tokenizer: Any, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's own split of a pair into tokens (trailing spaces of the context move to the
    continuation; the whole is encoded and cut at the context's length), scored in-process."""
    import torch

    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    cut = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float()
    logp = torch.log_softmax(logits[cut - 1 : len(whole) - 1], dim=-1)
    target = torch.tensor(whole[cut:])
    picked = logp.gather(-1, target[:, None]).squeeze(-1)
    return float(picked.sum()), bool((logp.argmax(-1) == target).all())


def evaluate(server: str, model: str, tokenizer_dir: Path, task_dir: Path) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model="local-completions",
        model_args={
            "model": model,
            "base_url": f"{server}/completions",
            "tokenizer": str(tokenizer_dir),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "num_concurrent": 4,
            "max_retries": 1,
        },
        tasks=["opentinker_sums"],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def test_lm_eval_scores_a_jobs_policy_through_the_endpoint_as_peft_scores_it(
    server: str,
    owner_key: tuple[Any, str],
    lora_job: Any,
    base_model_dir: Path,
    tinker_data_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("OPENAI_API_KEY", owner_key[1])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()), encoding="utf-8")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "sums.yaml").write_text(TASK.format(rows=data), encoding="utf-8")

    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(base_model_dir)).eval()
    adapter = tinker_data_dir / "jobs" / str(lora_job.pk) / "adapter"
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base_model_dir)), str(adapter)
    ).eval()

    scores = {}
    for name, model in ((f"job:{lora_job.pk}", tuned), (BASE_NAME, base)):
        out = evaluate(server, name, base_model_dir, tmp_path / "tasks")
        samples = out["samples"]["opentinker_sums"]
        assert len(samples) == len(rows())
        right = 0
        for sample in samples:
            got = [resp[0] for resp in sample["resps"]]
            want = [reference(model, tokenizer, *args) for args in sample["arguments"]]
            for (ll, greedy), (ref_ll, ref_greedy) in zip(got, want, strict=True):
                assert ll == pytest.approx(ref_ll, abs=1e-3), (name, sample["doc"])
                assert greedy == ref_greedy, (name, sample["doc"])
            right += int(max(range(len(want)), key=lambda i: want[i][0]) == sample["target"])
        accuracy = out["results"]["opentinker_sums"]["acc,none"]
        assert accuracy == pytest.approx(right / len(samples))
        print(f"lm-eval acc of {name}: {accuracy} (peft in-process: {right}/{len(samples)})")
        scores[name] = [resp[0][0] for s in samples for resp in s["resps"]]
    # The job's adapter, not the base model, scored the job's requests.
    assert scores[f"job:{lora_job.pk}"] != pytest.approx(scores[BASE_NAME], abs=1e-3)
