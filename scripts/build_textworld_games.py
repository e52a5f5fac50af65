"""Build the game pool of the `textworld` environment: generated household games (offline).

    .venv/bin/python scripts/build_textworld_games.py [--out DIR] [--train 4] [--held-out 2]

Two kinds, alternating within each split:
- cooking: `tw-make tw-cooking` (read the cookbook, take, cook, cut, prepare and eat a meal;
  one point per recipe step);
- quest: a GameMaker pick-and-place quest (open a container, take an object, walk one or two
  rooms, put the object on a supporter; one point). Its objective names the goal only ("Your
  task is to: put the red apple on the desk."), as ALFWorld's do, not the route.

Train and held-out games come from disjoint seeds (held-out seeds start at HELD_OUT_BASE), so an
evaluation on `held_out.jsonl` plays games no training row contains. Each game is compiled
once per (kind, seed) into DIR/<kind>-<seed>.z8 (+ the .json TextWorld reads beside it); a
rerun only replays the walkthroughs, which checks that every game can still be won.

Writes DIR/train.jsonl and DIR/held_out.jsonl, one row per game:
{"game": "cooking-0.z8", "kind", "seed", "split", "max_score", "walkthrough": [commands]}.
`game` is relative to DIR. The env opens games only under <OPENTINKER_DATA_DIR>/textworld-games
(OPENTINKER_DATA_DIR as the settings read it: var/ by default), the default DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT_BASE = 100_000
KINDS = ("cooking", "quest")
SPLITS = ("train", "held_out")
# One ingredient in one room, but every verb of the recipe is needed: open, cook, cut.
COOKING_FLAGS = ("--recipe", "1", "--take", "1", "--go", "1", "--open", "--cook", "--cut")

ROOMS = ("Kitchen", "Pantry", "Dining Room", "Living Room", "Bedroom", "Bathroom", "Study")
CONTAINERS = ("fridge", "cupboard", "wooden chest", "drawer", "cabinet", "wardrobe")
OBJECTS = ("red apple", "blue mug", "old book", "clean towel", "silver spoon", "glass jar")
SUPPORTERS = ("dining table", "kitchen counter", "bookshelf", "nightstand", "desk", "sofa")
DISTRACTORS = ("rubber duck", "pencil", "candle", "sock", "coin", "key ring")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}


def default_out() -> Path:
    """Where the env looks: <OPENTINKER_DATA_DIR>/textworld-games, as the settings resolve it."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "opentinker_site.settings.local")
    from environments.envs.textworld_env import games_root

    return games_root()


def plan(train: int, held_out: int) -> list[tuple[str, str, int]]:
    """(split, kind, seed) of every game in the pool."""
    games = []
    for split, count, base in (("train", train, 0), ("held_out", held_out, HELD_OUT_BASE)):
        games += [(split, KINDS[i % len(KINDS)], base + i) for i in range(count)]
    return games


def _tw_make() -> str:
    beside = Path(sys.executable).parent / "tw-make"
    return str(beside) if beside.exists() else "tw-make"


def _build_cooking(seed: int, target: Path) -> None:
    cmd = [_tw_make(), "tw-cooking", *COOKING_FLAGS, "--seed", str(seed)]
    subprocess.run(
        [*cmd, "--output", str(target), "--silent", "-f"],
        check=True,
        capture_output=True,
        timeout=600,
    )


def _build_quest(seed: int, target: Path) -> None:
    import textworld

    rng = random.Random(f"textworld-quest-{seed}")
    options = textworld.GameOptions()
    options.seeds = seed
    maker = textworld.GameMaker(options)
    names = rng.sample(ROOMS, 3)
    start = room = maker.new_room(names[0])
    container = maker.new(type="c", name=rng.choice(CONTAINERS))
    container.add_property("closed")
    start.add(container)
    thing = maker.new(type="o", name=rng.choice(OBJECTS))
    container.add(thing)
    start.add(maker.new(type="o", name=rng.choice(DISTRACTORS)))
    commands = [f"open {container.name}", f"take {thing.name} from {container.name}"]
    came_from = None
    for name in names[1 : 1 + rng.choice((1, 2))]:
        direction = rng.choice([d for d in OPPOSITE if d != came_from])
        nxt = maker.new_room(name)
        maker.connect(getattr(room, direction), getattr(nxt, OPPOSITE[direction]))
        commands.append(f"go {direction}")
        room, came_from = nxt, OPPOSITE[direction]
    supporter = maker.new(type="s", name=rng.choice(SUPPORTERS))
    room.add(supporter)
    maker.set_player(start)
    commands.append(f"put {thing.name} on {supporter.name}")
    maker.set_quest_from_commands(commands)
    game = maker.build()
    # GameMaker's own objective spells out every command; ALFWorld's style names the goal only.
    game.objective = f"Your task is to: put the {thing.name} on the {supporter.name}."
    compile_options = textworld.GameOptions()
    compile_options.path = str(target)
    compile_options.force_recompile = True
    textworld.generator.compile_game(game, compile_options)


BUILDERS: dict[str, Callable[[int, Path], None]] = {
    "cooking": _build_cooking,
    "quest": _build_quest,
}


def build_game(out: Path, kind: str, seed: int) -> Path:
    """DIR/<kind>-<seed>.z8, compiled unless it is there already."""
    path = out / f"{kind}-{seed}.z8"
    if path.exists() and path.with_suffix(".json").exists():
        return path
    # Compile aside and move into place, the .z8 last: a build that dies half way, or a
    # concurrent one, never leaves a game without its .json.
    with tempfile.TemporaryDirectory(dir=out, prefix=f".build-{kind}-{seed}-") as tmp:
        staged = Path(tmp) / path.name
        BUILDERS[kind](seed, staged)
        os.replace(staged.with_suffix(".json"), path.with_suffix(".json"))
        os.replace(staged, path)
    return path


def walk(path: Path) -> dict[str, Any]:
    """The game's max score and winning commands, checked by playing them."""
    import textworld

    infos = textworld.EnvInfos(policy_commands=True, max_score=True, won=True)
    env = textworld.start(str(path), request_infos=infos)
    try:
        state = env.reset()
        walkthrough = list(state["policy_commands"])
        max_score = int(state["max_score"])
        score = 0
        for command in walkthrough:
            state, score, _ = env.step(command)
        if not state["won"] or score != max_score:
            raise RuntimeError(f"{path.name}: the walkthrough scores {score}/{max_score}")
    finally:
        env.close()
    return {"max_score": max_score, "walkthrough": walkthrough}


def build_pool(
    out: Path, *, train: int = 4, held_out: int = 2, log: Callable[[str], None] = print
) -> dict[str, list[dict[str, Any]]]:
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    for split, kind, seed in plan(train, held_out):
        started = time.monotonic()
        path = build_game(out, kind, seed)
        row = {"game": path.name, "kind": kind, "seed": seed, "split": split, **walk(path)}
        rows[split].append(row)
        log(
            f"{split:8s} {path.name:20s} max_score {row['max_score']}  "
            f"{len(row['walkthrough'])} commands  {time.monotonic() - started:.1f}s"
        )
    for split, split_rows in rows.items():
        staged = out / f".{split}.jsonl.tmp-{os.getpid()}"
        staged.write_text("".join(json.dumps(r) + "\n" for r in split_rows))
        os.replace(staged, out / f"{split}.jsonl")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="pool directory")
    parser.add_argument("--train", type=int, default=4, help="training games")
    parser.add_argument("--held-out", type=int, default=2, help="held-out games")
    parser.add_argument("--clean", action="store_true", help="remove the pool's games first")
    args = parser.parse_args(argv)
    if args.train < 0 or args.held_out < 0:
        parser.error("--train and --held-out must be >= 0")
    out = args.out or default_out()
    if args.clean and out.exists():
        shutil.rmtree(out)
    started = time.monotonic()
    rows = build_pool(out, train=args.train, held_out=args.held_out)
    total = sum(len(r) for r in rows.values())
    print(f"{total} games in {out} ({time.monotonic() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
