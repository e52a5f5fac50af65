"""Dataset rows for the end-to-end jobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training import data


def addition_rows(n: int, offset: int = 0) -> list[dict[str, Any]]:
    """Rows of the math env's schema from the base model's pre-training split of additions."""
    train = data.addition_split()[0]
    return [
        {"question": p.question(i), "answer": str(p.answer)}
        for i, p in enumerate(train[offset : offset + n])
    ]


# Away from the seeds models/tiny-vl pre-trained on (scripts/build_tiny_vl_model.py).
GEOMETRY_FIRST_SEED = 3_000_000


def upload_angle_problems(client: Any, tmp_path: Path, n: int) -> str:
    """``n`` supplementary-angle problems (the known angle drawn and stated in the question,
    which tiny-vl answers about three times in four) uploaded as a `geometry` dataset
    through the API; returns its id."""
    from training import geometry

    seeds = range(GEOMETRY_FIRST_SEED, GEOMETRY_FIRST_SEED + n)
    rows = geometry.dataset_rows(seeds, ["supplementary"], values_in_text=True)
    path = tmp_path / "angles.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with path.open("rb") as handle:
        response = client.post(
            "/api/v1/datasets",
            {"file": handle, "name": "angles", "env": "geometry"},
            format="multipart",
        )
    assert response.status_code == 201, response.content
    return str(response.json()["id"])
