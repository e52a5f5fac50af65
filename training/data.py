"""Generated text for the project's tiny base model: arithmetic, instructions, code, games.

Everything here is a pure function of a `random.Random`, so the tokenizer corpus, the
pre-training stream and the held-out problems are the same on every machine. The formats are
the ones the built-in environments use: a final answer in `\\boxed{...}`, Python in a fenced
block, a bandit arm as `\\boxed{k}`, a gomoku move as `\\boxed{row,col}` (0-based).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

Message = dict[str, str]
Conversation = list[Message]

# Two-digit operands; the held-out split is over ordered pairs (a, b).
ADD_LOW, ADD_HIGH = 10, 99
_SPLIT_SEED = 20240611
TEST_SIZE = 400
VAL_SIZE = 200

_ADD_TEMPLATES = (
    "What is {a}+{b}?",
    "What is {a} + {b}?",
    "Compute {a}+{b}.",
    "Calculate {a} + {b}.",
    "What is the sum of {a} and {b}?",
    "Add {a} and {b}.",
)

_WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "table",
    "music",
    "light",
    "house",
    "train",
    "paper",
    "water",
    "tiger",
    "smile",
    "bread",
    "chair",
    "plant",
    "ocean",
    "night",
    "dream",
    "happy",
    "quick",
    "brown",
    "fox",
    "dog",
    "cat",
    "sun",
    "moon",
    "star",
    "tree",
    "book",
    "code",
)


@dataclass(frozen=True)
class AdditionProblem:
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    def question(self, template_index: int = 0) -> str:
        return _ADD_TEMPLATES[template_index % len(_ADD_TEMPLATES)].format(a=self.a, b=self.b)


def addition_split() -> tuple[list[AdditionProblem], list[AdditionProblem], list[AdditionProblem]]:
    """All 2-digit ordered pairs split into (train, validation, test), fixed for the project.

    The base model is pre-trained on `train` only; validation decides when pre-training stops
    and `test` is what accuracy is reported on, so neither is memorised.
    """
    pairs = [
        AdditionProblem(a, b)
        for a in range(ADD_LOW, ADD_HIGH + 1)
        for b in range(ADD_LOW, ADD_HIGH + 1)
    ]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    test = pairs[:TEST_SIZE]
    val = pairs[TEST_SIZE : TEST_SIZE + VAL_SIZE]
    train = pairs[TEST_SIZE + VAL_SIZE :]
    return train, val, test


def heldout_addition_problems(n: int | None = None) -> list[AdditionProblem]:
    """Held-out 2-digit additions the base model never saw (the test split)."""
    test = addition_split()[2]
    return test if n is None else test[:n]


ANSWER_FORMATS = ("boxed", "equation")


def addition_answer(problem: AdditionProblem, answer_format: str = "boxed") -> str:
    """`\\boxed{85}`, or `37+48=\\boxed{85}` (the equation puts the operands next to the sum)."""
    if answer_format == "boxed":
        return f"\\boxed{{{problem.answer}}}"
    if answer_format == "equation":
        return f"{problem.a}+{problem.b}=\\boxed{{{problem.answer}}}"
    raise ValueError(f"answer_format {answer_format!r}: expected one of {ANSWER_FORMATS}")


def addition_chat(
    problem: AdditionProblem, template_index: int = 0, answer_format: str = "boxed"
) -> Conversation:
    return [
        {"role": "user", "content": problem.question(template_index)},
        {"role": "assistant", "content": addition_answer(problem, answer_format)},
    ]


def _other_arithmetic(rng: random.Random) -> Conversation:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        question, answer = f"What is {a}+{b}?", a + b
    elif kind == 1:
        a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
        question, answer = f"What is {a}-{b}?", a - b
    elif kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        question, answer = f"What is {a}*{b}?", a * b
    else:
        a = rng.randint(10, 99)
        question, answer = f"What comes after {a}?", a + 1
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"\\boxed{{{answer}}}"},
    ]


def _instruction(rng: random.Random) -> Conversation:
    kind = rng.randrange(5)
    words = rng.sample(_WORDS, rng.randint(1, 3))
    if kind == 0:
        text = " ".join(words)
        question, answer = f"Repeat after me: {text}", text
    elif kind == 1:
        start = rng.randint(0, 20)
        stop = start + rng.randint(2, 6)
        question = f"Count from {start} to {stop}."
        answer = " ".join(str(i) for i in range(start, stop + 1))
    elif kind == 2:
        word = words[0]
        question, answer = f"Reverse the word {word}.", word[::-1]
    elif kind == 3:
        question, answer = "Say hello.", "Hello!"
    else:
        word = words[0]
        question, answer = f"Write the word {word} in capital letters.", word.upper()
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _code(rng: random.Random) -> Conversation:
    """A math_code episode: code in a fenced block, the tool output, then the boxed answer."""
    a, b = rng.randint(10, 999), rng.randint(2, 99)
    op = rng.choice(("+", "-", "*"))
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    if rng.random() < 0.5:
        code = f"print({a} {op} {b})"
    else:
        code = f"x = {a}\ny = {b}\nprint(x {op} y)"
    return [
        {
            "role": "user",
            "content": f"Use Python to compute {a} {op} {b}. "
            "Write code in a ```python block, then give the answer in \\boxed{}.",
        },
        {"role": "assistant", "content": f"```python\n{code}\n```"},
        {"role": "user", "content": f"Output:\n{value}"},
        {"role": "assistant", "content": f"\\boxed{{{value}}}"},
    ]


def bandit_prompt(n_arms: int = 5) -> str:
    return (
        f"You are playing a multi-armed bandit with {n_arms} arms numbered 0 to {n_arms - 1}. "
        "Choose one arm. Answer with \\boxed{arm}."
    )


def _bandit(rng: random.Random) -> Conversation:
    n_arms = rng.choice((3, 4, 5, 5, 5))
    arm = rng.randrange(n_arms)
    return [
        {"role": "user", "content": bandit_prompt(n_arms)},
        {"role": "assistant", "content": f"\\boxed{{{arm}}}"},
    ]


def render_board(board: list[list[str]]) -> str:
    size = len(board)
    header = "  " + " ".join(str(c) for c in range(size))
    rows = [f"{r} " + " ".join(board[r]) for r in range(size)]
    return "\n".join([header, *rows])


def gomoku_prompt(board: list[list[str]], player: str = "X", win: int = 4) -> str:
    size = len(board)
    return (
        f"Gomoku on a {size}x{size} board, {win} in a row wins. You play {player}.\n"
        f"{render_board(board)}\n"
        "Reply with your move as \\boxed{row,col}."
    )


def _gomoku(rng: random.Random) -> Conversation:
    size = rng.choice((5, 6, 7))
    board = [["." for _ in range(size)] for _ in range(size)]
    cells = [(r, c) for r in range(size) for c in range(size)]
    rng.shuffle(cells)
    n_stones = rng.randint(0, size * 2)
    for i in range(n_stones):
        r, c = cells[i]
        board[r][c] = "X" if i % 2 == 0 else "O"
    player = "X" if n_stones % 2 == 0 else "O"
    # A random legal move, not a good one: the base model knows the format, RL teaches play.
    r, c = cells[n_stones]
    return [
        {"role": "user", "content": gomoku_prompt(board, player)},
        {"role": "assistant", "content": f"\\boxed{{{r},{c}}}"},
    ]


_MISC_KINDS = (_other_arithmetic, _instruction, _code, _bandit, _gomoku)


def misc_chat(rng: random.Random) -> Conversation:
    """One non-addition conversation (other arithmetic, instructions, code, bandit, gomoku)."""
    return rng.choice(_MISC_KINDS)(rng)


def addition_chat_from(
    rng: random.Random, problems: list[AdditionProblem], answer_format: str = "boxed"
) -> Conversation:
    # Mostly the canonical wording (the one evaluated), sometimes a paraphrase.
    template = 0 if rng.random() < 0.7 else rng.randrange(len(_ADD_TEMPLATES))
    return addition_chat(rng.choice(problems), template, answer_format)


def tokenizer_corpus(rng: random.Random, n: int) -> list[str]:
    """Conversation text (role names and contents) to train the BPE on."""
    train = addition_split()[0]
    texts: list[str] = []
    for i in range(n):
        if i % 3 == 0:
            conv = addition_chat_from(rng, train)
        else:
            conv = misc_chat(rng)
        texts.append("".join(f"{m['role']}\n{m['content']}\n" for m in conv))
    return texts


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """The last `\\boxed{}` content, else the last number in the text, else None."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None
