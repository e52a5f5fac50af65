"""Engine benchmarks: each result is a ratio against a baseline measured in the same run.

    .venv/bin/python bench/engine.py [--model tiny] [--threads 2] [--only train,sample,grpo,pack,vl]

1. train:  `forward_backward` + `optim_step` tokens/s vs a plain transformers + peft step on
           the same batch (goal >= 1.0x).
2. sample: 8 adapters x 8 prompts in one multi-LoRA batch vs 8 sequential single-adapter peft
           `generate` calls, fixed length (goal >= 3x).
3. grpo:   one GRPO step (sample a group, score, update) vs TRL's GRPOTrainer with the same
           model, LoRA rank, group size and lengths (goal >= 1.5x).
4. pack:   `forward_backward` + `optim_step` on 16 datums of 10-1000 tokens packed end to end
           vs padded to the longest (the gain), and vs rows of the longest length without
           padding (the engine's own tokens/s on long rows; goal >= 0.8x).
5-6. vl:   the same training step and multi-LoRA sampling on the tiny vision-language model
           with a diagram in every prompt, vs transformers + peft (`bench/engine_vl.py`).

Timings are medians over repeated runs, ours and the baseline interleaved, because these
machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from training import data, onednn, ops, packing, rl
from training.engine import Engine
from training.lora import DEFAULT_TARGET_MODULES
from training.sampler import SampleRequest, generate, sample
from training.types import AdamParams, Datum, SamplingParams

RANK, ALPHA = 8, 16
N_ADAPTERS, PROMPTS_PER_ADAPTER, SAMPLE_TOKENS = 8, 8, 16
GROUP, GRPO_PROMPTS, GRPO_TOKENS = 8, 8, 16
LR = 1e-4


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved(
    ours: Callable[[], object], theirs: Callable[[], object], rounds: int, reps: int
) -> tuple[float, float]:
    ours()
    theirs()  # warm-up: allocator, kernels, lazy inits
    mine, base = [], []
    for _ in range(rounds):
        mine.append(median_time(ours, reps))
        base.append(median_time(theirs, reps))
    return statistics.median(mine), statistics.median(base)


def _chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _peft_model(model_path: str, adapters: int):
    from peft import LoraConfig, get_peft_model

    from training.model import load_base

    model, _ = load_base(model_path, device="cpu", dtype=torch.float32)
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(DEFAULT_TARGET_MODULES), lora_dropout=0.0
    )
    peft_model = get_peft_model(model, config, adapter_name="a0")
    for i in range(1, adapters):
        peft_model.add_adapter(f"a{i}", config)
    return peft_model


# -- 1. training step ------------------------------------------------------------------------


def bench_train(model_path: str) -> dict[str, float]:
    engine = Engine(model_path, device="cpu")
    tokenizer = engine.tokenizer
    rng = __import__("random").Random(0)
    train = data.addition_split()[0]
    seqs = []
    for i in range(32):
        conv = data.addition_chat_from(rng, train) if i % 2 else data.misc_chat(rng)
        text = tokenizer.apply_chat_template(conv, tokenize=False)
        seqs.append(tokenizer.encode(text, add_special_tokens=False))
    datums = [Datum.from_sequence(s) for s in seqs]
    n_tokens = sum(d.length for d in datums)

    policy = engine.create_policy(rank=RANK, alpha=ALPHA, seed=0)
    adam = AdamParams(learning_rate=LR)

    def ours() -> None:
        ops.forward_backward(policy, datums, "cross_entropy")
        ops.optim_step(policy, adam)

    peft_model = _peft_model(model_path, 1)
    peft_model.train()
    optim = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR)
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    targets = ids[:, 1:]
    weights = attn[:, 1:].float()

    def theirs() -> None:
        logits = peft_model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1]).logits
        logp = (
            torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        )
        loss = -(logp * weights).sum()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    mine, base = _interleaved(ours, theirs, rounds=3, reps=3)
    return {
        "tokens": n_tokens,
        "ours_tok_s": n_tokens / mine,
        "peft_tok_s": n_tokens / base,
        "ratio": base / mine,
    }


# -- 4. packed batches ----------------------------------------------------------------------

# A long multi-turn batch: 16 datums from 10 to 1000 tokens, spaced evenly on a log scale.
PACK_LENGTHS = [round(10 * 100 ** (i / 15)) for i in range(16)]


def bench_pack(model_path: str, rounds: int) -> dict[str, float]:
    """`forward_backward` + `optim_step` on the mixed-length batch packed vs padded to its
    longest datum, and packed vs a batch of the same shape without any padding to gain (rows
    as long as the longest datum, as many as the packed batch has): the engine's tokens/s on
    long sequences, which packing should come close to."""
    engine = Engine(model_path, device="cpu")
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def batch(lengths: list[int]) -> list[Datum]:
        return [
            Datum.from_sequence(torch.randint(3, vocab, (n + 1,), generator=gen)) for n in lengths
        ]

    mixed = batch(PACK_LENGTHS)
    longest = max(PACK_LENGTHS)
    layout = packing.plan(PACK_LENGTHS, ["p"] * len(PACK_LENGTHS), torch.device("cpu"))
    assert layout is not None, "the mixed batch must be packed"
    full_rows = batch([longest] * layout.rows)
    policy = engine.create_policy(rank=RANK, alpha=ALPHA, seed=0)
    adam = AdamParams(learning_rate=LR)

    def step(datums: list[Datum], pack: bool | None) -> Callable[[], None]:
        def run() -> None:
            ops.forward_backward(policy, datums, "cross_entropy", pack=pack)
            ops.optim_step(policy, adam)

        return run

    packed_s, padded_s = _interleaved(step(mixed, None), step(mixed, False), rounds, reps=1)
    full_s = median_time(step(full_rows, False), repeats=rounds)
    mixed_tokens = sum(PACK_LENGTHS)
    full_tokens = longest * layout.rows
    return {
        "tokens": mixed_tokens,
        "rows": layout.rows,
        "packed_tok_s": mixed_tokens / packed_s,
        "padded_tok_s": mixed_tokens / padded_s,
        "full_tok_s": full_tokens / full_s,
        "gain": padded_s / packed_s,
        "vs_full": (mixed_tokens / packed_s) / (full_tokens / full_s),
    }


# -- 2. multi-LoRA sampling ------------------------------------------------------------------


def bench_sample(model_path: str) -> dict[str, float]:
    engine = Engine(model_path, device="cpu")
    tokenizer = engine.tokenizer
    gen = torch.Generator().manual_seed(0)
    keys = []
    for i in range(N_ADAPTERS):
        policy = engine.create_policy(rank=RANK, alpha=ALPHA, seed=i)
        with torch.no_grad():
            for _, b in policy.lora_weights.values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
        keys.append(policy.version_key(policy.snapshot()))
    problems = data.heldout_addition_problems(PROMPTS_PER_ADAPTER)
    prompts = [_chat_ids(tokenizer, p.question(i)) for i, p in enumerate(problems)]
    params = SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=0)
    all_prompts = prompts * N_ADAPTERS
    all_keys = [k for k in keys for _ in prompts]

    def ours() -> None:
        seqs = generate(
            engine.model,
            tokenizer,
            all_prompts,
            params,
            adapters=all_keys,
            host=engine.host,
            stop_on_eos=False,
        )
        assert all(len(s.tokens) == SAMPLE_TOKENS for s in seqs)

    peft_model = _peft_model(model_path, N_ADAPTERS)
    peft_model.eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1

    def theirs() -> None:
        with torch.no_grad():
            for i in range(N_ADAPTERS):
                peft_model.set_adapter(f"a{i}")
                out = peft_model.generate(
                    input_ids=ids,
                    attention_mask=attn,
                    max_new_tokens=SAMPLE_TOKENS,
                    min_new_tokens=SAMPLE_TOKENS,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    pad_token_id=tokenizer.pad_token_id,
                )
                assert out.shape[1] == width + SAMPLE_TOKENS

    def ours_without_onednn() -> None:
        # The same call with every projection through F.linear (MKL), as the baseline runs.
        saved = onednn._state.get("ok")
        onednn._state["ok"] = False
        try:
            ours()
        finally:
            onednn._state["ok"] = saved

    mine, base = _interleaved(ours, theirs, rounds=3, reps=2)
    mkl, _ = _interleaved(ours_without_onednn, theirs, rounds=1, reps=3)
    return {
        "ours_s": mine,
        "peft_s": base,
        "ratio": base / mine,
        "ours_mkl_s": mkl,
        "ratio_mkl": base / mkl,
        "onednn": bool(onednn.available()),
    }


# -- 3. GRPO step ----------------------------------------------------------------------------


def _reward(text: str, answer: int) -> float:
    return 1.0 if data.final_answer(text) == str(answer) else 0.0


def bench_grpo(model_path: str, steps: int) -> dict[str, float]:
    problems = data.addition_split()[0][: GRPO_PROMPTS * (steps + 2)]

    engine = Engine(model_path, device="cpu")
    tokenizer = engine.tokenizer
    policy = engine.create_policy(rank=RANK, alpha=ALPHA, seed=0)
    version = policy.snapshot()
    params = SamplingParams(max_tokens=GRPO_TOKENS, temperature=1.0)
    adam = AdamParams(learning_rate=LR)
    batches = [problems[i * GRPO_PROMPTS : (i + 1) * GRPO_PROMPTS] for i in range(steps + 1)]
    rewards_seen: list[float] = []
    skipped_groups: list[int] = []

    def grpo_step(batch: list[data.AdditionProblem]) -> None:
        nonlocal version
        prompts = [_chat_ids(tokenizer, p.question()) for p in batch]
        requests = [
            SampleRequest(p, params, n=GROUP, policy_id=policy.id, version=version) for p in prompts
        ]
        groups = sample(engine, requests)
        datums = []
        for prompt, problem, group in zip(prompts, batch, groups):
            rewards = [
                _reward(tokenizer.decode(s.tokens, skip_special_tokens=True), problem.answer)
                for s in group
            ]
            rewards_seen.extend(rewards)
            advantages = rl.grpo(rewards)
            if not bool(advantages.any()):
                # All rewards equal: zero advantage everywhere, so this group's gradient under
                # the importance-sampling loss is exactly zero. Skipping it changes no update.
                skipped_groups.append(1)
                continue
            datums += [rl.sample_to_datum(prompt, s, float(a)) for s, a in zip(group, advantages)]
        if datums:
            ops.forward_backward(policy, datums, "importance_sampling")
        ops.optim_step(policy, adam)
        version = policy.snapshot()

    ours_times = []
    for batch in batches:
        start = time.perf_counter()
        grpo_step(batch)
        ours_times.append(time.perf_counter() - start)
    ours = statistics.median(ours_times[1:])

    trl = _trl_grpo_step_time(model_path, problems, steps)
    return {
        "ours_s": ours,
        "trl_s": trl,
        "ratio": trl / ours,
        "mean_reward": statistics.mean(rewards_seen),
        "skipped_groups": len(skipped_groups) / (GRPO_PROMPTS * len(batches)),
    }


def _trl_grpo_step_time(model_path: str, problems: list[data.AdditionProblem], steps: int) -> float:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from training.model import load_base

    model, tokenizer = load_base(model_path, device="cpu", dtype=torch.float32)
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": p.question()}], "answer": p.answer}
            for p in problems
        ]
    )

    def reward_fn(completions, answer, **_kwargs) -> list[float]:
        return [_reward(c[-1]["content"], a) for c, a in zip(completions, answer)]

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, *args, **kwargs) -> None:
            self._start = time.perf_counter()

        def on_step_end(self, *args, **kwargs) -> None:
            self.times.append(time.perf_counter() - self._start)

    timer = Timer()
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=GROUP * GRPO_PROMPTS,
            num_generations=GROUP,
            max_completion_length=GRPO_TOKENS,
            temperature=1.0,
            learning_rate=LR,
            beta=0.0,
            num_iterations=1,
            gradient_accumulation_steps=1,
            max_steps=steps + 1,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            shuffle_dataset=False,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward_fn,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(
                r=RANK,
                lora_alpha=ALPHA,
                target_modules=list(DEFAULT_TARGET_MODULES),
                lora_dropout=0.0,
            ),
            callbacks=[timer],
        )
        trainer.train()
    return statistics.median(timer.times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description="engine benchmarks (ratios)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="train,sample,grpo,pack,vl")
    parser.add_argument("--grpo-steps", type=int, default=6)
    parser.add_argument("--pack-rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    wanted = set(args.only.split(","))
    print(f"engine benchmarks: model={args.model} threads={args.threads} torch={torch.__version__}")
    if "train" in wanted:
        r = bench_train(args.model)
        print(
            f"1. forward_backward+optim_step: {r['ours_tok_s']:.0f} tok/s vs transformers+peft "
            f"{r['peft_tok_s']:.0f} tok/s ({r['tokens']} tokens/batch, LoRA r{RANK}): "
            f"{r['ratio']:.2f}x (goal >= 1.0x)"
        )
    if "sample" in wanted:
        r = bench_sample(args.model)
        print(
            f"2. multi-LoRA sampling {N_ADAPTERS} adapters x {PROMPTS_PER_ADAPTER} prompts x "
            f"{SAMPLE_TOKENS} tokens: {r['ours_s'] * 1000:.0f} ms vs {N_ADAPTERS} sequential peft "
            f"generate {r['peft_s'] * 1000:.0f} ms: {r['ratio']:.2f}x (goal >= 3x)"
        )
        print(
            f"   projections through F.linear (MKL) as in the baseline, instead of oneDNN "
            f"({'used' if r['onednn'] else 'not available'}): {r['ours_mkl_s'] * 1000:.0f} ms, "
            f"{r['ratio_mkl']:.2f}x"
        )
    if "pack" in wanted:
        r = bench_pack(args.model, args.pack_rounds)
        print(
            f"4. packed batch, {len(PACK_LENGTHS)} datums of {min(PACK_LENGTHS)}-"
            f"{max(PACK_LENGTHS)} tokens ({r['tokens']} tokens in {r['rows']} packed rows), "
            f"forward_backward+optim_step: packed {r['packed_tok_s']:.0f} tok/s vs padded to the "
            f"longest {r['padded_tok_s']:.0f} tok/s: {r['gain']:.2f}x; vs {r['rows']} unpadded "
            f"rows of {max(PACK_LENGTHS)} tokens {r['full_tok_s']:.0f} tok/s: {r['vs_full']:.2f}x "
            f"(goal >= 0.8x)"
        )
    if "grpo" in wanted:
        r = bench_grpo(args.model, args.grpo_steps)
        print(
            f"3. GRPO step ({GRPO_PROMPTS} prompts x group {GROUP}, <= {GRPO_TOKENS} tokens, LoRA "
            f"r{RANK}): {r['ours_s'] * 1000:.0f} ms vs TRL GRPOTrainer {r['trl_s'] * 1000:.0f} ms: "
            f"{r['ratio']:.2f}x (goal >= 1.5x); mean reward {r['mean_reward']:.2f}, "
            f"{r['skipped_groups']:.0%} of groups had zero advantage and were skipped"
        )
    if "vl" in wanted:
        from bench import engine_vl

        r = engine_vl.bench_vl_train(_interleaved)
        print(
            f"5. VL forward_backward+optim_step ({engine_vl.VL_MODEL}, {engine_vl.TRAIN_ROWS} "
            f"rows with a diagram each, {r['tokens']} tokens, LoRA r{engine_vl.RANK}): "
            f"{r['ours_tok_s']:.0f} tok/s vs transformers+peft {r['peft_tok_s']:.0f} tok/s: "
            f"{r['ratio']:.2f}x (goal >= 1.0x)"
        )
        r = engine_vl.bench_vl_sample(_interleaved)
        print(
            f"6. VL multi-LoRA sampling {engine_vl.N_ADAPTERS} adapters x "
            f"{engine_vl.PROMPTS_PER_ADAPTER} prompts with a diagram x "
            f"{engine_vl.SAMPLE_TOKENS} tokens: {r['ours_tok_s']:.0f} tok/s vs "
            f"{engine_vl.N_ADAPTERS} sequential peft generate {r['peft_tok_s']:.0f} tok/s: "
            f"{r['ratio']:.2f}x (goal >= 1.0x)"
        )


if __name__ == "__main__":
    main()
