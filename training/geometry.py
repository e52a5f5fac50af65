"""Synthetic geometry problems in geometry3k's shape: a diagram, a question, a numeric answer.

geometry3k (the dataset vision-language RL recipes train on) pairs a diagram with labelled
values and a question such as "Find x."; it cannot be downloaded here, so these problems are
drawn locally with PIL: triangles, straight and right angles, segments, rectangles, right
triangles and circles, each with its values written on the figure. Every problem is a pure
function of its seed, so a split of seeds is a split of problems.

`values_in_text` also states the labelled values in the question: the figure then says only
which relation holds (which shape, which angle is which), as in the easier geometry3k items.

The pre-training of the project's tiny vision-language model (`scripts/build_tiny_vl_model.py`)
adds captions of the same figures: naming a shape and its colour, reading a number.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SIZE = 112
# (kind, question) -> (labels drawn, answer); each kind draws its own figure.
KINDS = (
    "triangle_angle",
    "supplementary",
    "complementary",
    "segment_sum",
    "rectangle_perimeter",
    "right_triangle",
    "circle_diameter",
)
SHAPES = ("triangle", "square", "circle", "pentagon", "hexagon")
COLORS = {
    "red": (220, 30, 30),
    "green": (20, 160, 40),
    "blue": (30, 60, 220),
    "black": (0, 0, 0),
    "orange": (240, 140, 0),
    "purple": (140, 40, 170),
}
_TRIPLES = ((3, 4, 5), (6, 8, 10), (5, 12, 13), (9, 12, 15), (8, 15, 17), (12, 16, 20), (7, 24, 25))


@dataclass(frozen=True)
class Problem:
    """One row: ``images`` (PNG bytes), ``problem`` (geometry3k puts ``<image>`` where the
    figure goes), ``answer`` (a number as text) and what drew it."""

    image: bytes
    problem: str
    answer: str
    kind: str
    seed: int

    def row(self) -> dict[str, Any]:
        """The geometry3k-shaped row (images as PNG bytes)."""
        return {"images": [self.image], "problem": self.problem, "answer": self.answer}


def _font(size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _canvas() -> tuple[Any, Any]:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), "white")
    return image, ImageDraw.Draw(image)


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def _label(draw: Any, xy: tuple[float, float], text: str, size: int = 15) -> None:
    font = _font(size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    x = min(max(xy[0] - (right - left) / 2, 1), SIZE - (right - left) - 1)
    y = min(max(xy[1] - (bottom - top) / 2 - top, 1), SIZE - bottom - 1)
    draw.text((x, y), text, fill=(0, 0, 0), font=font)


def _triangle_angle(rng: random.Random) -> tuple[Any, list[str], str, str]:
    a, b = rng.randint(25, 80), rng.randint(25, 80)
    image, draw = _canvas()
    apex_x = rng.randint(40, 72)
    points = [(10, 96), (102, 96), (apex_x, 18)]
    draw.polygon(points, outline=(0, 0, 0), width=2)
    _label(draw, (28, 84), f"{a}°")
    _label(draw, (84, 84), f"{b}°")
    _label(draw, (apex_x, 36), "x°")
    return image, [f"{a}", f"{b}"], "Find x.", str(180 - a - b)


def _straight(rng: random.Random, total: int) -> tuple[Any, list[str], str, str]:
    a = rng.randint(20, total - 20)
    image, draw = _canvas()
    center = (56, 80)
    if total == 180:
        draw.line([(6, 80), (106, 80)], fill=(0, 0, 0), width=2)
    else:
        draw.line([(30, 80), (106, 80)], fill=(0, 0, 0), width=2)
        draw.line([(30, 80), (30, 10)], fill=(0, 0, 0), width=2)
        draw.rectangle([(30, 70), (40, 80)], outline=(0, 0, 0))
        center = (30, 80)
    angle = math.radians(a)
    end = (center[0] + 70 * math.cos(angle), center[1] - 70 * math.sin(angle))
    draw.line([center, end], fill=(0, 0, 0), width=2)
    first = math.radians(a / 2)
    second = math.radians(a + (total - a) / 2)
    _label(draw, (center[0] + 30 * math.cos(first), center[1] - 30 * math.sin(first)), f"{a}°")
    _label(draw, (center[0] + 26 * math.cos(second), center[1] - 26 * math.sin(second)), "x°")
    return image, [f"{a}"], "Find x.", str(total - a)


def _segment_sum(rng: random.Random) -> tuple[Any, list[str], str, str]:
    a, b = rng.randint(10, 49), rng.randint(10, 49)
    image, draw = _canvas()
    split = 10 + round(92 * a / (a + b))
    draw.line([(10, 60), (102, 60)], fill=(0, 0, 0), width=2)
    for x, name in ((10, "A"), (split, "B"), (102, "C")):
        draw.ellipse([(x - 3, 57), (x + 3, 63)], fill=(0, 0, 0))
        _label(draw, (x, 76), name, 13)
    _label(draw, ((10 + split) / 2, 44), str(a))
    _label(draw, ((split + 102) / 2, 44), str(b))
    return image, [f"AB = {a}", f"BC = {b}"], "Find AC.", str(a + b)


def _rectangle(rng: random.Random) -> tuple[Any, list[str], str, str]:
    a, b = rng.randint(3, 24), rng.randint(3, 24)
    image, draw = _canvas()
    draw.rectangle([(22, 30), (90, 82)], outline=(0, 0, 0), width=2)
    _label(draw, (56, 18), str(a))
    _label(draw, (102, 56), str(b))
    return image, [f"{a}", f"{b}"], "Find the perimeter of the rectangle.", str(2 * (a + b))


def _right_triangle(rng: random.Random) -> tuple[Any, list[str], str, str]:
    p, q, r = rng.choice(_TRIPLES)
    if rng.random() < 0.5:
        p, q = q, p
    image, draw = _canvas()
    draw.polygon([(16, 92), (96, 92), (16, 20)], outline=(0, 0, 0), width=2)
    draw.rectangle([(16, 82), (26, 92)], outline=(0, 0, 0))
    _label(draw, (56, 103), str(p))
    _label(draw, (8, 56), str(q))
    _label(draw, (64, 50), "x")
    return image, [f"{p}", f"{q}"], "Find x.", str(r)


def _circle(rng: random.Random) -> tuple[Any, list[str], str, str]:
    r = rng.randint(3, 49)
    image, draw = _canvas()
    draw.ellipse([(16, 16), (96, 96)], outline=(0, 0, 0), width=2)
    draw.line([(56, 56), (96, 56)], fill=(0, 0, 0), width=2)
    draw.ellipse([(53, 53), (59, 59)], fill=(0, 0, 0))
    _label(draw, (76, 44), str(r))
    return image, [f"radius {r}"], "Find the diameter of the circle.", str(2 * r)


_DRAW: dict[str, Callable[[random.Random], tuple[Any, list[str], str, str]]] = {
    "triangle_angle": _triangle_angle,
    "supplementary": lambda rng: _straight(rng, 180),
    "complementary": lambda rng: _straight(rng, 90),
    "segment_sum": _segment_sum,
    "rectangle_perimeter": _rectangle,
    "right_triangle": _right_triangle,
    "circle_diameter": _circle,
}


def problem(seed: int, kinds: Sequence[str] = KINDS, *, values_in_text: bool = False) -> Problem:
    """The problem of ``seed``: its kind drawn from ``kinds``, then its values."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {list(KINDS)}, got {unknown}")
    rng = random.Random(seed)
    kind = sorted(kinds)[rng.randrange(len(kinds))]
    image, values, question, answer = _DRAW[kind](rng)
    if values_in_text:
        question = f"In the figure, {' and '.join(values)}. {question}"
    return Problem(_png(image), f"<image>{question}", answer, kind, seed)


def problems(
    seeds: Sequence[int], kinds: Sequence[str] = KINDS, *, values_in_text: bool = False
) -> list[Problem]:
    return [problem(s, kinds, values_in_text=values_in_text) for s in seeds]


def dataset_rows(
    seeds: Sequence[int], kinds: Sequence[str] = KINDS, *, values_in_text: bool = False
) -> list[dict[str, Any]]:
    """geometry3k-shaped rows as the `geometry` env's datasets hold them (JSONL: each image
    base64-encoded), with the kind and seed that drew each."""
    import base64

    return [
        {
            "images": [base64.b64encode(p.image).decode("ascii")],
            "problem": p.problem,
            "answer": p.answer,
            "kind": p.kind,
            "seed": p.seed,
        }
        for p in problems(seeds, kinds, values_in_text=values_in_text)
    ]


# ------------------------------------------------------------------------------ captions


def shape_picture(rng: random.Random) -> tuple[bytes, str, str]:
    """A filled shape: (PNG, shape name, colour name)."""
    shape = rng.choice(SHAPES)
    color = rng.choice(sorted(COLORS))
    image, draw = _canvas()
    cx, cy = rng.randint(40, 72), rng.randint(40, 72)
    radius = rng.randint(22, 36)
    fill = COLORS[color]
    if shape == "circle":
        draw.ellipse([(cx - radius, cy - radius), (cx + radius, cy + radius)], fill=fill)
    elif shape == "square":
        half = radius * 0.8
        draw.rectangle([(cx - half, cy - half), (cx + half, cy + half)], fill=fill)
    else:
        sides = {"triangle": 3, "pentagon": 5, "hexagon": 6}[shape]
        turn = rng.random() * 2 * math.pi
        points = [
            (
                cx + radius * math.cos(turn + 2 * math.pi * k / sides),
                cy + radius * math.sin(turn + 2 * math.pi * k / sides),
            )
            for k in range(sides)
        ]
        draw.polygon(points, fill=fill)
    return _png(image), shape, color


def number_picture(rng: random.Random) -> tuple[bytes, str]:
    """A number written somewhere on the canvas: (PNG, the number)."""
    value = str(rng.randint(0, 199))
    image, draw = _canvas()
    _label(draw, (rng.randint(24, 88), rng.randint(20, 92)), value, rng.choice((15, 18, 22)))
    return _png(image), value
