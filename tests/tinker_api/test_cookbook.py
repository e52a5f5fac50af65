"""tinker-cookbook's own machinery against a live OpenTinker (real HTTP server, real API key,
real Celery worker, real model worker on the tiny base model).

- ``tinker_cookbook.supervised.train`` with the cookbook's ``FromConversationFileBuilder`` over
  our arithmetic data, and ``checkpoint_utils`` save + resume of the same run.
- ``tinker_cookbook.rl.train`` with a ``ProblemEnv`` dataset builder over the same data, its
  default loss and ``stable_reinforce`` (the cookbook's provenance spans and stability info).
- The minimal recipes ``recipes/sl_loop.py`` and ``recipes/rl_loop.py`` run from their installed
  source with only the lines that name a hub dataset or look the renderer up in the model
  registry swapped (``RECIPE_EDITS`` below lists every edit), and both learn.
- ``recipes/multiplayer_rl/text_arena`` through its own ``build_config``: TicTacToe self-play
  training and evaluation against the base model.

The tiny model's chat template is ChatML without a system turn: the cookbook's
``qwen3_instruct`` renderer produces exactly its tokens (checked below). The SDK's tokenizer
lookup for the base model's name goes through the cookbook's ``register_tokenizer`` hook.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "tinker_cookbook.rl.train",
    reason="tinker-cookbook 0.6.1 (a test dependency) is not importable with its runtime deps",
    exc_type=ImportError,
)
import chz
from tinker_cookbook import checkpoint_utils, renderers
from tinker_cookbook.rl import problem_env
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import register_tokenizer

from tests.tinker_api.conftest import BASE_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "environments" / "data" / "arith_train.jsonl"
RENDERER = "qwen3_instruct"


@pytest.fixture
def server(
    live_tinker: str,
    owner_key: tuple[Any, str],
    base_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> str:
    """The live server's URL; the SDK finds it and the key in the environment, as a user's
    script would (``TINKER_BASE_URL``, ``TINKER_API_KEY``), and the cookbook its tokenizer."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("TINKER_API_KEY", "tml-" + owner_key[1])
    monkeypatch.setenv("TINKER_BASE_URL", live_tinker + "/")
    register_tokenizer(BASE_NAME, lambda: AutoTokenizer.from_pretrained(str(base_model_dir)))
    return live_tinker + "/"


def _rows(kind: str | None = None, limit: int = 400) -> list[dict[str, str]]:
    rows = [json.loads(line) for line in ARITH.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["kind"] == kind][:limit]


def _metrics(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def _tiny_model_or_skip(base_model_dir: Path) -> None:
    from training.model import DEFAULT_BASE_MODEL

    if str(base_model_dir) != DEFAULT_BASE_MODEL:
        pytest.skip("needs the project's tiny chat model (scripts/build_tiny_model.py)")


def test_it_uses_a_renderer_that_reproduces_the_tiny_models_chat_template(
    base_model_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    _tiny_model_or_skip(base_model_dir)
    tok = AutoTokenizer.from_pretrained(str(base_model_dir))
    renderer = renderers.get_renderer(RENDERER, tok)
    convo = [{"role": "user", "content": "What is 9*3?"}, {"role": "assistant", "content": "27"}]
    model_input, _weights = renderer.build_supervised_example(convo)
    expected = tok.apply_chat_template(convo, tokenize=False)
    assert tok.decode(model_input.to_ints()) + "\n" == expected
    prompt = renderer.build_generation_prompt(convo[:1])
    assert tok.decode(prompt.to_ints()) == tok.apply_chat_template(
        convo[:1], tokenize=False, add_generation_prompt=True
    )


# --------------------------------------------------------------------------- supervised.train


def test_it_runs_supervised_train_and_resumes_from_its_checkpoint(
    server: str, base_model_dir: Path, tmp_path: Path
) -> None:
    _tiny_model_or_skip(base_model_dir)
    data = tmp_path / "arith_chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": r["question"]},
                        {"role": "assistant", "content": f"\\boxed{{{r['answer']}}}"},
                    ]
                }
            )
            + "\n"
            for r in _rows(limit=256)
        )
    )
    log_path = tmp_path / "sl"

    def config(max_steps: int) -> sl_train.Config:
        return sl_train.Config(
            log_path=str(log_path),
            model_name=BASE_NAME,
            recipe_name="opentinker_test_sl",
            renderer_name=RENDERER,
            dataset_builder=FromConversationFileBuilder(
                file_path=str(data),
                common_config=ChatDatasetBuilderCommonConfig(
                    model_name_for_tokenizer=BASE_NAME,
                    renderer_name=RENDERER,
                    max_length=128,
                    batch_size=16,
                ),
            ),
            learning_rate=5e-3,
            lora_rank=8,
            save_every=2,
            eval_every=0,
            max_steps=max_steps,
            base_url=server,
        )

    asyncio.run(sl_train.main(config(4)))
    steps_before = [m["step"] for m in _metrics(log_path) if "train_mean_nll" in m]
    assert steps_before == [0, 1, 2, 3], steps_before
    # Make it a run that died after its step-2 checkpoint: drop the "final" record the
    # finished run appended, so the last checkpoint is 000002 (batch 2).
    index = log_path / "checkpoints.jsonl"
    records = [json.loads(line) for line in index.read_text().splitlines()]
    assert [r["name"] for r in records] == ["000002", "final"], records
    index.write_text(json.dumps(records[0]) + "\n")
    resume = checkpoint_utils.get_last_checkpoint(str(log_path))
    assert resume is not None and resume.state_path.endswith("/weights/000002")

    # The second run on the same log directory loads that state (weights and optimizer)
    # through the SDK and trains batches 2 and 3 again rather than starting over: the
    # cookbook sets the old rows from step 2 on aside and logs new ones.
    asyncio.run(sl_train.main(config(4)))
    before = [
        json.loads(x)
        for x in (log_path / "metrics.jsonl.pre_resume_000002").read_text().splitlines()
    ]
    after = [m for m in _metrics(log_path) if "train_mean_nll" in m]
    assert [m["step"] for m in after] == [0, 1, 2, 3], after
    assert after[:2] == [m for m in before if "train_mean_nll" in m][:2]
    # The server's optimizer continued from the saved Adam state (its step counter did not
    # restart at 1).
    assert after[2]["optim/step:mean"] > after[1]["optim/step:mean"], after
    nll = [m["train_mean_nll"] for m in _metrics(log_path) if "train_mean_nll" in m]
    assert all(math.isfinite(x) for x in nll)
    assert min(nll[-2:]) < nll[0], nll


# --------------------------------------------------------------------------- rl.train


class _ArithEnv(problem_env.ProblemEnv):
    def __init__(self, renderer: Any, question: str, answer: str) -> None:
        super().__init__(renderer, format_coef=0.1)
        self.question, self.answer = question, answer

    def get_question(self) -> str:
        return self.question

    def check_answer(self, sample_str: str) -> bool:
        from training.data import final_answer

        return final_answer(sample_str) == self.answer

    def check_format(self, sample_str: str) -> bool:
        return "\\boxed{" in sample_str

    def get_reference_answer(self) -> str:
        return self.answer


class _ArithDataset(RLDataset):
    def __init__(self, rows: list[dict[str, str]], renderer: Any, batch: int, group: int) -> None:
        self.rows, self.renderer, self.batch, self.group = rows, renderer, batch, group

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        rows = self.rows[index * self.batch : (index + 1) * self.batch]
        return [
            problem_env.ProblemGroupBuilder(
                env_thunk=lambda r=r: _ArithEnv(self.renderer, r["question"], r["answer"]),
                num_envs=self.group,
                dataset_name="arith",
            )
            for r in rows
        ]

    def __len__(self) -> int:
        return len(self.rows) // self.batch


@chz.chz
class ArithRLDatasetBuilder(RLDatasetBuilder):
    """Problems from environments/data/arith_train.jsonl as cookbook ProblemEnvs."""

    base_model_dir: str
    batch_size: int = 2
    group_size: int = 4

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        from transformers import AutoTokenizer

        renderer = renderers.get_renderer(
            RENDERER, AutoTokenizer.from_pretrained(self.base_model_dir)
        )
        return _ArithDataset(_rows("add", 64), renderer, self.batch_size, self.group_size), None


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "stable_reinforce"])
def test_it_runs_rl_train_with_a_local_dataset_builder(
    server: str, base_model_dir: Path, tmp_path: Path, loss_fn: str
) -> None:
    _tiny_model_or_skip(base_model_dir)
    log_path = tmp_path / "rl"
    config = rl_train.Config(
        learning_rate=1e-3,
        dataset_builder=ArithRLDatasetBuilder(base_model_dir=str(base_model_dir)),
        model_name=BASE_NAME,
        recipe_name="opentinker_test_rl",
        renderer_name=RENDERER,
        max_tokens=12,
        log_path=str(log_path),
        loss_fn=loss_fn,  # type: ignore[arg-type]
        lora_rank=8,
        eval_every=0,
        save_every=2,
        max_steps=2,
        num_groups_to_log=0,
        rollout_json_export=False,
        base_url=server,
    )
    asyncio.run(rl_train.main(config))
    steps = [m for m in _metrics(log_path) if "env/all/reward/total" in m]
    assert [m["step"] for m in steps] == [0, 1], steps
    for m in steps:
        assert math.isfinite(m["env/all/reward/total"]), m
        # The cookbook compares the sampler's logprobs with the trainer's forward pass: the
        # server's sampler and trainer agree on the same weights.
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m
    final = checkpoint_utils.get_last_checkpoint(str(log_path))
    assert final is not None and final.state_path.startswith("tinker://")


# --------------------------------------------------------------------------- recipes


def _recipe(name: str, edits: list[tuple[str, str]]) -> tuple[str, dict[str, Any]]:
    """The installed recipe's source with ``edits`` applied; each must match exactly once,
    so a changed recipe fails here rather than running something else."""
    import importlib.util

    spec = importlib.util.find_spec(f"tinker_cookbook.recipes.{name}")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    for old, new in edits:
        assert source.count(old) == 1, f"recipe {name}: expected one {old!r}"
        source = source.replace(old, new)
    # chz resolves a config class's annotations through its module: give the recipe one.
    module = types.ModuleType(f"opentinker_recipe_{name}")
    sys.modules[module.__name__] = module
    return source, module.__dict__


SL_EDITS = [
    # The hub dataset -> our arithmetic problems as chat messages.
    ('datasets.load_dataset("HuggingFaceH4/no_robots")', "LOCAL_DATASET"),
    # The model registry lookup -> the renderer that fits the tiny model's ChatML template.
    ("model_info.get_recommended_renderer_name(config.model_name)", "LOCAL_RENDERER"),
]

RL_EDITS = [
    ('datasets.load_dataset("openai/gsm8k", "main")', "LOCAL_DATASET"),
    ("model_info.get_recommended_renderer_name(config.model_name)", "LOCAL_RENDERER"),
    # GSM8K's prompt dressing (an instruction suffix and a one-shot example about strawberries)
    # belongs to that dataset; our problems carry their own instruction.
    (
        'question_suffix = " Provide a numerical answer without units, '
        'written inside \\\\boxed{}."',
        'question_suffix = ""',
    ),
    ("        *convo_prefix,\n", ""),
]


def test_it_runs_the_sl_loop_recipe_on_local_data_and_the_loss_falls(
    server: str, base_model_dir: Path, tmp_path: Path
) -> None:
    import datasets

    _tiny_model_or_skip(base_model_dir)
    source, ns = _recipe("sl_loop", SL_EDITS)
    rows = _rows(limit=640)
    ns["LOCAL_DATASET"] = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(
                [
                    {
                        "messages": [
                            {"role": "user", "content": r["question"]},
                            {"role": "assistant", "content": f"\\boxed{{{r['answer']}}}"},
                        ]
                    }
                    for r in rows
                ]
            )
        }
    )
    ns["LOCAL_RENDERER"] = RENDERER
    exec(compile(source, "sl_loop.py", "exec"), ns)
    log_path = tmp_path / "sl-loop"
    ns["main"](
        ns["Config"](
            base_url=server,
            log_path=str(log_path),
            model_name=BASE_NAME,
            batch_size=16,
            learning_rate=5e-3,
            lora_rank=8,
            save_every=0,
            max_steps=8,
        )
    )
    nll = [m["train_mean_nll"] for m in _metrics(log_path)]
    assert len(nll) == 8
    assert sum(nll[-2:]) / 2 < 0.8 * sum(nll[:2]) / 2, nll
    assert checkpoint_utils.get_last_checkpoint(str(log_path)) is not None


def test_it_runs_the_rl_loop_recipe_with_stable_reinforce_and_the_reward_rises(
    server: str, base_model_dir: Path, tmp_path: Path
) -> None:
    """The arithmetic problems are beyond the 3M-parameter model (about 2% right), so a few
    steps could not show learning on them: the recipe runs on the project's bandit problem
    (``training.data.bandit_prompt``, arm 3 pays), answers in GSM8K's ``#### n`` form so the
    recipe's own reward function grades them unchanged."""
    import datasets

    from training.data import bandit_prompt

    _tiny_model_or_skip(base_model_dir)
    source, ns = _recipe("rl_loop", RL_EDITS)
    ns["LOCAL_DATASET"] = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(
                [{"question": bandit_prompt(5), "answer": "#### 3"}] * 64
            )
        }
    )
    ns["LOCAL_RENDERER"] = RENDERER
    exec(compile(source, "rl_loop.py", "exec"), ns)
    log_path = tmp_path / "rl-loop"
    config = ns["Config"](
        base_url=server,
        log_path=str(log_path),
        model_name=BASE_NAME,
        batch_size=1,
        group_size=16,
        learning_rate=2e-3,
        lora_rank=8,
        save_every=0,
        max_tokens=8,
        max_steps=10,
    )
    assert config.loss_fn == "stable_reinforce"  # the recipe's default, unchanged
    ns["main"](config)
    rewards = [m["reward/total"] for m in _metrics(log_path)]
    assert len(rewards) == 10
    # One group of 16 a step is a noisy estimate: compare the mean of the first two steps with
    # that of the last three (at 4e-3 the policy sometimes overshot and fell back for a step).
    assert sum(rewards[-3:]) / 3 > sum(rewards[:2]) / 2 + 0.3, rewards


def test_it_runs_the_text_arena_recipe_in_self_play_and_evaluates_against_the_base_model(
    server: str, base_model_dir: Path, tmp_path: Path
) -> None:
    """recipes/multiplayer_rl/text_arena as its own ``build_config`` makes it: TicTacToe
    self-play batches for training, games against the base model (sampled through the
    server) for evaluation; only the sizes are the test's."""
    _tiny_model_or_skip(base_model_dir)
    pytest.importorskip("textarena")
    from tinker_cookbook.recipes.multiplayer_rl.text_arena import train as text_arena

    from jobs.models import BaseModel

    # TicTacToe's first observation is ~660 tokens: the tiny model's own context (1,024
    # positions), not the 512 the other tests of this module give it.
    BaseModel.objects.filter(name=BASE_NAME).update(max_context=1024)

    log_path = tmp_path / "text_arena"
    cli = text_arena.CLIConfig(
        model_name=BASE_NAME,
        renderer_name=RENDERER,
        batch_size=4,
        num_train_datapoints=8,
        num_test_datapoints=2,
        max_tokens=16,
        eval_every=1,
        save_every=2,
        log_path=str(log_path),
        max_steps=2,
    )
    asyncio.run(rl_train.main(text_arena.build_config(cli)))
    metrics = _metrics(log_path)
    steps = [m for m in metrics if "env/all/reward/total" in m]
    assert [m["step"] for m in steps] == [0, 1], metrics
    for m in steps:
        assert math.isfinite(m["env/all/reward/total"]), m
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m
    evaluated = [m for m in metrics if any(k.startswith("test/") for k in m)]
    assert evaluated, metrics
