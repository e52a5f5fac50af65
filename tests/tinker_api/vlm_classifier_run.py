"""The cookbook's vlm_classifier recipe (``python -m tinker_cookbook.recipes.vlm_classifier.train``)
with its random horizontal flips decided by each picture alone, and its adapter's initial
weights by a fixed seed.

The recipe flips a training picture with ``random.random() < 0.5`` as it converts it, and its
test split draws from the same global generator (with a probability of 0). The evaluators
convert test pictures while training batches are converted, so the order of the draws, and
with it which pictures are flipped, followed the timing of the run: seeding the generator once
left held-out accuracies from 0.28 to 0.75 after three epochs. Seeded from each picture's
bytes before it is converted, a picture is flipped or not whatever ran beside it. The recipe
sends no seed for its LoRA adapter, so the server draws one: a seed of 0 makes the run the same
from one time to the next. Everything else runs as the recipe has it.
"""

from __future__ import annotations

import random
import runpy
import zlib
from typing import Any

import tinker
from tinker_cookbook.recipes.vlm_classifier import data

_convert = data.ClassifierDataset.build_supervised_example


def _seeded(self: Any, example: dict[str, Any]) -> Any:
    image = example[self.config.image_column_name]
    raw = image["bytes"] if isinstance(image, dict) and "bytes" in image else image.tobytes()
    random.seed(zlib.crc32(raw))
    return _convert(self, example)


data.ClassifierDataset.build_supervised_example = _seeded  # type: ignore[method-assign]

_create = tinker.ServiceClient.create_lora_training_client


def _create_seeded(self: Any, *args: Any, seed: int | None = None, **kwargs: Any) -> Any:
    return _create(self, *args, seed=0 if seed is None else seed, **kwargs)


tinker.ServiceClient.create_lora_training_client = _create_seeded  # type: ignore[method-assign]

if __name__ == "__main__":
    runpy.run_module(
        "tinker_cookbook.recipes.vlm_classifier.train", run_name="__main__", alter_sys=True
    )
