"""Model FLOP utilisation of the engine on a real-sized model, against this machine's limits.

    .venv/bin/python bench/mfu.py [--threads N] [--batch 8] [--seq 256] [--write]
    python bench/mfu.py --device cuda [--dtype bfloat16] [--batch 64] [--seq 1024]

The model is a Qwen2-architecture decoder of ~76M parameters (hidden 768, 12 layers, GQA 12/4
heads, MLP 2048, the tiny model's 737-token vocabulary, tied head), randomly initialised from
a fixed seed on the first run and cached under ``var/mfu-model``. Nothing is downloaded.

Measured in the same run, on the same threads and backend:

- peak: the best of large float32 GEMMs (2048^3, through both backends the engine uses:
  ``torch.mm`` on MKL and oneDNN's packed matmul), in FLOP/s, and bandwidth:
  the best of 512 MiB tensor copies (bytes read + written per second), both measured between
  the rounds of each phase (``Limits``);
- training: ``ops.forward_backward`` + ``ops.optim_step`` on ``batch`` x ``seq`` tokens, LoRA
  r16 on every linear layer and full fine-tuning. FLOPs per token: full = 6 N + 12 L d T
  (weights forward, backward to activations and to weights, plus attention scores and values,
  T = sequence length); LoRA = 4 N + 6 N_lora + 12 L d T (the frozen weights get no weight
  gradient). N counts the matmul weights, the tied output head included;
- prefill: ``ops.forward`` on the same batch: 2 N + 4 L d T per token;
- decode: one sequence (batch 1), ``sampler.generate`` for 64 tokens after a 16-token prompt,
  minus a 1-token run: each decode step reads every weight once (fp32) plus the KV cache; that
  byte rate is reported against the measured bandwidth.

MFU = achieved FLOP/s / peak FLOP/s. Peak RSS (``ru_maxrss``) is printed after each phase; it
only grows, so the full fine-tuning figure includes the earlier phases.

On a GPU (``--device cuda``, bfloat16 by default) the same phases run on the device: the peak
is the best 8192^3 GEMM in the run's dtype (``torch.mm``: cuBLAS, tensor cores), the
bandwidth the best 2 GiB device-to-device copy and read-only pass, every timing ends with a
``torch.cuda.synchronize()``, the weights and KV cache are read at the dtype's width, and the
memory figure is the device's peak allocation. Its results go to a section of their own.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import write_section as record

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from training import ops
from training.engine import Engine
from training.model import DEFAULT_BASE_MODEL
from training.sampler import generate
from training.types import AdamParams, Datum, SamplingParams

MODEL_DIR = ROOT / "var" / "mfu-model"
CONFIG = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}
SEED = 7
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_RANK = 16
GEMM = {"cpu": 2048, "cuda": 8192}
COPY_BYTES = {"cpu": 512 * 2**20, "cuda": 2 * 2**30}
PROMPT_TOKENS, DECODE_TOKENS = 16, 64


def build_model() -> Path:
    """The cached model directory, built on first use (weights from SEED, the tiny tokenizer)."""
    if (MODEL_DIR / "config.json").is_file():
        return MODEL_DIR
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_BASE_MODEL)
    torch.manual_seed(SEED)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **CONFIG,
    )
    model = Qwen2ForCausalLM(config)
    tmp = MODEL_DIR.with_name(MODEL_DIR.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(MODEL_DIR)
    return MODEL_DIR


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a GPU call returns before its kernels end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def best_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    return min(timed(fn, device) for _ in range(repeats))


class Limits:
    """The machine's limits, measured between the rounds of each phase.

    On a shared machine the load changes from one minute to the next: a peak measured once at
    the start can be taken at a quieter or a busier moment than the phase it divides. Taking
    the best of interleaved rounds on both sides compares the least disturbed moments.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.gemm = GEMM[device.type]
        self.copy_bytes = COPY_BYTES[device.type]
        self.a = torch.randn(self.gemm, self.gemm, device=device, dtype=dtype)
        self.b = torch.randn(self.gemm, self.gemm, device=device, dtype=dtype)
        self.src = torch.ones(self.copy_bytes // 4, device=device)
        self.dst = torch.empty_like(self.src)
        self.flops = 0.0
        self.bandwidth = 0.0
        self.read_bandwidth = 0.0
        # The device memory these buffers hold throughout, which a phase's own peak excludes.
        self.held = sum(t.numel() * t.element_size() for t in (self.a, self.b, self.src, self.dst))
        self.phase_peak = 0

    def measure(self) -> None:
        gemm = best_time(lambda: torch.mm(self.a, self.b), 2, self.device)
        from training import onednn

        if onednn.usable(self.a, self.b):
            # The engine's no-grad projections run on oneDNN's packed matmul, which on some
            # CPUs (AMD's, where MKL takes a generic path) is twice MKL's sgemm: the machine's
            # peak is the faster of the two backends the engine uses.
            with torch.no_grad():
                packed = best_time(lambda: onednn.linear(self.a, self.b, None), 2, self.device)
            gemm = min(gemm, packed)
        copy = best_time(lambda: self.dst.copy_(self.src), 2, self.device)
        # Decode only reads; a sum over the same bytes is the read-only rate.
        read = best_time(lambda: self.src.sum(), 2, self.device)
        self.flops = max(self.flops, 2 * self.gemm**3 / gemm)
        self.bandwidth = max(self.bandwidth, 2 * self.copy_bytes / copy)
        self.read_bandwidth = max(self.read_bandwidth, self.copy_bytes / read)

    def phase(self, fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
        """(best seconds of ``fn``, peak FLOP/s, bandwidth) over interleaved rounds."""
        self.flops = self.bandwidth = self.read_bandwidth = 0.0
        self.phase_peak = 0
        fn()
        times = []
        for _ in range(repeats):
            self.measure()
            if self.device.type == "cuda":
                # The peak of ``fn`` alone, not of the GEMM and copy measured between rounds.
                torch.cuda.reset_peak_memory_stats(self.device)
            times.append(timed(fn, self.device))
            if self.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(self.device) - self.held
                self.phase_peak = max(self.phase_peak, peak)
        self.measure()
        return min(times), self.flops, self.bandwidth


def matmul_params(cfg: Any) -> int:
    """Weights that take part in a matmul: every projection and the (tied) output head once.

    Counted from the config: the engine swaps the Linear modules for its own LoRA-aware ones.
    """
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * cfg.intermediate_size
    return layers * per_layer + cfg.vocab_size * d


def peak_memory_gib(limits: Limits) -> float:
    """The process's peak RSS on the CPU; on a GPU, the device's peak allocation during the
    last phase's timed rounds, less the benchmark's own buffers."""
    if limits.device.type == "cuda":
        return limits.phase_peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def batch(vocab: int, rows: int, length: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(rows):
        ids = torch.randint(3, vocab, (length + 1,), generator=gen)
        out.append(Datum.from_sequence(ids.tolist()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="weights and activations (default: float32 on the CPU, bfloat16 on a GPU)",
    )
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args()
    if min(args.threads, args.batch, args.seq, args.repeats) < 1:
        parser.error("--threads, --batch, --seq and --repeats must be >= 1")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device: {exc}")
    if device.type not in GEMM:
        parser.error(f"--device: {args.device!r} is neither cpu nor cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    loadavg = "/".join(f"{v:.2f}" for v in os.getloadavg())

    engine = Engine(build_model(), device=device, dtype=dtype)
    model = engine.model
    cfg = model.config
    n = matmul_params(cfg)
    layers, d, t = cfg.num_hidden_layers, cfg.hidden_size, args.seq
    attention = 12 * layers * d * t
    datums = batch(cfg.vocab_size, args.batch, args.seq)
    tokens = args.batch * args.seq
    limits = Limits(device, dtype)
    print(f"model: {n / 1e6:.1f}M matmul parameters, {args.dtype} on {device}")
    results: dict[str, Any] = {"n": n, "tokens": tokens}

    def report(name: str, seconds: float, per_token: float, peak: float) -> None:
        flops = per_token * tokens / seconds
        memory = peak_memory_gib(limits)
        results[name] = {
            "tok_s": tokens / seconds,
            "mfu": flops / peak,
            "peak": peak,
            "rss": memory,
        }
        print(
            f"{name}: {tokens / seconds:.0f} tokens/s, {flops / 1e9:.1f} GFLOP/s against a peak "
            f"of {peak / 1e9:.1f}: MFU {flops / peak:.1%}; peak memory {memory:.2f} GiB"
        )

    for name, full in (("lora", False), ("full", True)):
        policy = engine.create_policy(rank=LORA_RANK, alpha=2 * LORA_RANK, full_finetune=full)
        adam = AdamParams(learning_rate=1e-5)
        lora_n = 0 if full else sum(p.numel() for p in policy.parameters())

        def step(policy: Any = policy, adam: AdamParams = adam) -> None:
            ops.forward_backward(policy, datums, "cross_entropy")
            ops.optim_step(policy, adam)

        seconds, peak, _ = limits.phase(step, args.repeats)
        report(name, seconds, (6 * n if full else 4 * n + 6 * lora_n) + attention, peak)
        if name == "lora":
            with torch.no_grad():
                seconds, peak, _ = limits.phase(
                    lambda p=policy: ops.forward(p, datums), args.repeats
                )
            report("prefill", seconds, 2 * n + attention / 3, peak)
        engine.remove_policy(policy.id)

    prompt = [datums[0].model_input[:PROMPT_TOKENS].tolist()]

    def decode(tokens_out: int) -> Callable[[], object]:
        params = SamplingParams(max_tokens=tokens_out, temperature=1.0, seed=0)
        return lambda: generate(model, engine.tokenizer, prompt, params, stop_on_eos=False)

    one, _, _ = limits.phase(decode(1), args.repeats)
    many, _, bw = limits.phase(decode(DECODE_TOKENS + 1), args.repeats)
    per_step = (many - one) / DECODE_TOKENS
    kv_heads = cfg.num_key_value_heads
    head_dim = d // cfg.num_attention_heads
    mean_ctx = PROMPT_TOKENS + DECODE_TOKENS / 2
    width = torch.finfo(dtype).bits // 8
    step_bytes = width * n + 2 * layers * kv_heads * head_dim * mean_ctx * width
    read_bw = limits.read_bandwidth
    results["decode"] = {
        "tok_s": 1 / per_step,
        "fraction": step_bytes / per_step / bw,
        "bandwidth": bw,
        "read_fraction": step_bytes / per_step / read_bw,
        "read_bandwidth": read_bw,
        "rate": step_bytes / per_step,
    }
    print(
        f"decode (batch 1): {1 / per_step:.1f} tokens/s, {step_bytes / per_step / 1e9:.2f} GB/s "
        f"of weights and KV read against {bw / 1e9:.1f} GB/s copied: "
        f"{step_bytes / per_step / bw:.1%} of the bandwidth ({step_bytes / per_step / read_bw:.1%} "
        f"of the {read_bw / 1e9:.1f} GB/s a read-only pass reaches)"
    )
    if args.write:
        command = f".venv/bin/python bench/mfu.py --threads {args.threads} --batch {args.batch} --seq {args.seq} --write"
        if device.type == "cuda":
            command = f"python bench/mfu.py --device cuda --dtype {args.dtype} --batch {args.batch} --seq {args.seq} --write"
            print(f"wrote {write_gpu_section(results, command, args, device)}")
        else:
            print(f"wrote {write_section(results, command, loadavg, args)}")


def write_section(r: dict[str, Any], command: str, loadavg: str, args: argparse.Namespace) -> Path:
    section = f"""## MFU on a 76M-parameter model

Command: `{command}` ({time.strftime("%Y-%m-%d")}, {os.cpu_count()} CPU cores, {args.threads}
torch threads, Python {platform.python_version()}, torch {torch.__version__}, load average
before the run {loadavg}).

A Qwen2-architecture model built by the benchmark ({r["n"] / 1e6:.1f}M matmul parameters,
hidden 768, 12 layers), {args.dtype}, batch {args.batch} x {args.seq} tokens. Each phase is timed
in rounds interleaved with the machine's limits, the best 2048^3 GEMM on MKL (`torch.mm`) or
oneDNN's packed matmul, whichever is faster (peak FLOP/s), and
the best 512 MiB copy (bytes read + written per second) and the best read-only pass over the
same bytes (a sum), and the best round of each side is compared, so that both are taken at
the quietest moments of the same minutes.

| Phase | Tokens/s | Fraction of the machine's limit | Goal |
|---|---|---|---|
| Train, LoRA r16 (all linears) | {r["lora"]["tok_s"]:.0f} | MFU **{r["lora"]["mfu"]:.1%}** of {r["lora"]["peak"] / 1e9:.0f} GFLOP/s | >= 30% |
| Train, full fine-tuning | {r["full"]["tok_s"]:.0f} | MFU **{r["full"]["mfu"]:.1%}** of {r["full"]["peak"] / 1e9:.0f} GFLOP/s | >= 30% |
| Prefill (forward only) | {r["prefill"]["tok_s"]:.0f} | MFU {r["prefill"]["mfu"]:.1%} of {r["prefill"]["peak"] / 1e9:.0f} GFLOP/s | |
| Decode, batch 1 | {r["decode"]["tok_s"]:.1f} | **{r["decode"]["fraction"]:.1%}** of the {r["decode"]["bandwidth"] / 1e9:.1f} GB/s copied ({r["decode"]["rate"] / 1e9:.1f} GB/s read; {r["decode"]["read_fraction"]:.1%} of the {r["decode"]["read_bandwidth"] / 1e9:.1f} GB/s of a read-only pass) | >= 50% |

Peak RSS: {r["lora"]["rss"]:.2f} GiB after LoRA training, {r["full"]["rss"]:.2f} GiB after
full fine-tuning (AdamW moments for every weight). FLOPs per token: full 6N + 12LdT, LoRA
4N + 6N_lora + 12LdT, prefill 2N + 4LdT; decode reads 4N bytes of weights and the KV cache
per token.
"""
    return record("MFU on a 76M-parameter model", section, keep_subsections=True)


def write_gpu_section(
    r: dict[str, Any], command: str, args: argparse.Namespace, device: torch.device
) -> Path:
    name = torch.cuda.get_device_name(device)
    section = f"""## MFU on a GPU

Command: `{command}` ({time.strftime("%Y-%m-%d")}, {name}, torch {torch.__version__}).

The same model as the CPU section above ({r["n"] / 1e6:.1f}M matmul parameters), in
{args.dtype}, batch {args.batch} x {args.seq} tokens; the peak is the best 8192^3 {args.dtype}
GEMM (`torch.mm`, cuBLAS) and the bandwidth the best 2 GiB device copy, both measured between
the rounds of each phase.

| Phase | Tokens/s | Fraction of the device's limit | Goal |
|---|---|---|---|
| Train, LoRA r16 (all linears) | {r["lora"]["tok_s"]:.0f} | MFU **{r["lora"]["mfu"]:.1%}** of {r["lora"]["peak"] / 1e12:.0f} TFLOP/s | >= 40% |
| Train, full fine-tuning | {r["full"]["tok_s"]:.0f} | MFU **{r["full"]["mfu"]:.1%}** of {r["full"]["peak"] / 1e12:.0f} TFLOP/s | >= 40% |
| Prefill (forward only) | {r["prefill"]["tok_s"]:.0f} | MFU {r["prefill"]["mfu"]:.1%} of {r["prefill"]["peak"] / 1e12:.0f} TFLOP/s | |
| Decode, batch 1 | {r["decode"]["tok_s"]:.1f} | **{r["decode"]["fraction"]:.1%}** of the {r["decode"]["bandwidth"] / 1e9:.0f} GB/s copied ({r["decode"]["rate"] / 1e9:.0f} GB/s read; {r["decode"]["read_fraction"]:.1%} of a read-only pass) | >= 50% |

Peak device memory: {r["lora"]["rss"]:.2f} GiB after LoRA training, {r["full"]["rss"]:.2f} GiB
after full fine-tuning.
"""
    return record("MFU on a GPU", section, keep_subsections=True)


if __name__ == "__main__":
    main()
