"""Demonstrations of a two-player TextArena game as an SFT dataset for the `math` env.

    .venv/bin/python scripts/build_textarena_demos.py --game Nim-v0 [--games 400] [--seed 0]
        [--model-seat 0] [--action-format boxed|text] [--no-rules] --out var/nim-demos.jsonl

Plays games of the `textarena` env against its random legal-move opponent, the model's seat
also playing random legal moves, and writes one row per model turn: `question` is the
observation exactly as the env shows it on that turn (the rules and the board on the first,
only what is new on later ones), `context` the game's earlier turns (observations and boxed
moves, as an RL rollout holds them), `answer` the move without its brackets. An SFT job on
these rows with `env: math` (its default config shows the context, then the question as the
user message) teaches a base model the game's move format in the game's own conversation;
`action_format: "boxed"` in the textarena job's `env_config` then reads the SFT job's
`\\boxed{0 3}` as the move `[0 3]`. With `--action-format text` each row also carries a
`completion`, the move exactly as the game asks for it (`[check]`): SFT teaches that reply of
a few tokens, and the RL job's `action_format: "text"` plays it as given. `--no-rules`
builds the observations without the game's rules (the env's `rules: false`, which the RL job
then sets too). The moves are legal and random: what RL then learns about playing well is
its own.

Seeds: game i uses seed `--seed + i`; a job's evaluation plays seeds from 1,000,000,007
(workers.runners.evaluation), which these games never reach.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--game", default="Nim-v0")
    parser.add_argument("--games", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-seat", type=int, default=0)
    parser.add_argument("--action-format", choices=("boxed", "text"), default="boxed")
    parser.add_argument(
        "--no-rules", action="store_true", help="observations without the game's rules"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.games < 1:
        raise SystemExit("--games: at least 1")
    from environments.envs.textarena_env import demonstration_rows

    try:
        rows = demonstration_rows(
            args.game,
            args.games,
            args.seed,
            args.model_seat,
            args.action_format,
            rules=not args.no_rules,
        )
    except ValueError as exc:
        raise SystemExit(f"--game: {exc}") from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{args.out}: {len(rows)} rows from {args.games} games of {args.game}")


if __name__ == "__main__":
    main()
