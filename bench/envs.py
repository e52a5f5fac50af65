"""Episodes per second: environments stepped inline vs through a Celery env worker.

    .venv/bin/python bench/envs.py [--groups 20] [--group-size 8]

Starts one real env worker (`celery worker -Q env`, prefork, 1 process) on the configured Redis
(the embedded Valkey by default), plays the same groups with the same scripted policy both ways
and prints episodes/s for each path and the worker path's time as a ratio to inline. The policy
is a trivial function, so the numbers are the environments' own cost plus, on the queue path,
one task round trip per turn of a group.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def scripted(env: str, row: dict | None = None):
    from environments.rollouts import PolicyInput

    def policy(inp: PolicyInput) -> str:
        text = inp.messages[-1]["content"]
        if env == "textworld":
            # The game's own walkthrough, one command a turn: it wins the game.
            assert row is not None
            return row["walkthrough"][sum(m["role"] == "assistant" for m in inp.messages)]
        if env == "reasoning_gym":
            # chain_sum: "... arithmetic problem: 42 - 25 =" -> the right answer, boxed.
            terms = re.findall(r"-?\d+|[+-]", text.split(":")[-1].split("=")[0])
            total, sign = 0, 1
            for term in terms:
                if term in "+-":
                    sign = 1 if term == "+" else -1
                else:
                    total += sign * int(term)
            return f"\\boxed{{{total}}}"
        if env == "textarena":
            # TicTacToe against the random opponent: the first move the game lists.
            seen = "\n".join(m["content"] for m in inp.messages if m["role"] == "user")
            listed = re.findall(r"Available Moves:[^\n]*", seen)
            moves = re.findall(r"'(\[[^']*\])'", listed[-1]) if listed else []
            return moves[0] if moves else "[4]"
        if env == "scienceworld":
            return "look around"
        if env == "bandit":
            return "\\boxed{1}"
        if env == "math":
            return "\\boxed{42}"
        if env == "math_code":
            if text.startswith("Output:"):
                value = text.split("\n", 1)[1].strip()
                return f"\\boxed{{{value}}}"
            return "```python\nprint(20 + 22)\n```"
        rows = [line.split()[1:] for line in text.splitlines() if line[:1].isdigit()]
        empty = [(r, c) for r, row in enumerate(rows) for c, v in enumerate(row) if v == "."]
        r, c = empty[len(empty) // 2]
        return f"\\boxed{{{r},{c}}}"

    return policy


def start_worker(redis_url: str) -> tuple[subprocess.Popen, Path]:
    log_path = Path(tempfile.mkdtemp(prefix="bench-envs-")) / "worker.log"
    env = dict(os.environ, REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "opentinker_site",
        "worker",
        "--queues=env",
        "--include=environments.tasks",
        "--concurrency=1",
        "--pool=prefork",
        f"--hostname=bench-{uuid.uuid4().hex[:6]}@%h",
        "--without-gossip",
        "--without-mingle",
        "--loglevel=WARNING",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    from opentinker_site.celery import app

    deadline = time.monotonic() + 60
    while not app.control.ping(timeout=0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"env worker did not start:\n{log_path.read_text(errors='replace')}")
    return proc, log_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "opentinker_site.settings.local")
    import django

    django.setup()
    from django.conf import settings

    from environments.envs.textworld_env import games_root
    from environments.registry import build_group, group_specs
    from environments.remote import run_group_remote
    from environments.rollouts import run_group

    pool = games_root()
    if not (pool / "train.jsonl").exists():
        # Offline and cached: compiled once per machine.
        script = ROOT / "scripts" / "build_textworld_games.py"
        subprocess.run([sys.executable, str(script), "--out", str(pool)], check=True)
    games = [json.loads(line) for line in (pool / "train.jsonl").read_text().splitlines()]
    proc, _ = start_worker(str(settings.REDIS_URL))
    rows = [{"question": "What is 20+22?", "answer": "42"}]
    plan = {
        "bandit": args.groups,
        "math": args.groups,
        "gomoku": max(1, args.groups // 4),
        # Every episode runs the sandbox once (~0.1 s), so fewer groups keep the run short.
        "math_code": max(1, args.groups // 10),
        "reasoning_gym": args.groups,
        "textarena": max(1, args.groups // 4),
        # One JVM per live episode (~1.5 s to start): one group is enough to see the cost.
        "scienceworld": max(1, args.groups // 20),
        # Each game's walkthrough (5-20 commands) through TextWorld's Z-machine interpreter.
        "textworld": max(1, args.groups // 5),
    }
    configs = {
        "reasoning_gym": {
            "dataset": "chain_sum",
            "options": {"min_terms": 2, "max_terms": 3},
            "answer_format": "boxed",
        },
        "textarena": {"game": "TicTacToe-v0", "opponent": "random"},
        "scienceworld": {"task": "find-living-thing", "max_turns": 4},
        "textworld": {"max_turns": 32},
    }
    env_rows = {"math": rows, "math_code": rows, "textworld": games}
    print(
        f"{'env':<14} {'episodes':>8} {'inline ep/s':>12} {'queue ep/s':>11} "
        f"{'queue/inline time':>18}"
    )
    try:
        for env, n_groups in plan.items():
            specs = group_specs(
                env,
                config=configs.get(env),
                rows=env_rows.get(env),
                n_groups=n_groups,
                group_size=args.group_size,
                seed=1,
            )
            policies = [scripted(env, s.get("row")) for s in specs]
            run_group_remote(policies[0], specs[0])  # warm-up: imports and connections
            t0 = time.perf_counter()
            inline = [run_group(p, build_group(s)) for p, s in zip(policies, specs)]
            t_inline = time.perf_counter() - t0
            t0 = time.perf_counter()
            remote = [run_group_remote(p, s) for p, s in zip(policies, specs)]
            t_remote = time.perf_counter() - t0
            n = sum(len(g) for g in inline)
            same = all(
                a.rewards_per_turn == b.rewards_per_turn
                for ga, gb in zip(inline, remote)
                for a, b in zip(ga, gb)
            )
            print(
                f"{env:<14} {n:>8} {n / t_inline:>12.1f} {n / t_remote:>11.1f} "
                f"{t_remote / t_inline:>17.2f}x{'' if same else '  (REWARDS DIFFER)'}"
            )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


if __name__ == "__main__":
    main()
