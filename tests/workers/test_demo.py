"""`manage.py demo` from an empty data directory: the README's main command, end to end.

The default demo (an RL job on the tiny model, minutes long) is measured in
docs/benchmarks.md; here the smoke variant runs the same path through the HTTP API, and the
default spec is checked against the same validation a submission gets.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.served import embedded_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.live
@pytest.mark.timeout(180)
def test_it_runs_the_demo_job_through_the_http_api(tmp_path: Path) -> None:
    env = embedded_env(tmp_path, "demonode")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "manage.py"),
            "demo",
            "--smoke",
            "--steps",
            "2",
            "--step-seconds",
            "0.2",
            "--port",
            "0",
            "--timeout",
            "120",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=170,
    )
    serve_log = tmp_path / "serve.log"
    log = serve_log.read_text(errors="replace") if serve_log.exists() else ""
    assert out.returncode == 0, out.stdout + out.stderr + log
    assert re.search(r"^\s+otk_\S+$", out.stdout, re.MULTILINE), out.stdout
    assert "state SUCCEEDED on demonode" in out.stdout
    assert re.search(r"step 2: .*residual=", out.stdout)
    assert out.stdout.rstrip().endswith("demo job SUCCEEDED")


def test_it_ships_a_default_demo_spec_that_validates() -> None:
    from jobs.spec import check_base_model_limits, parse_spec
    from workers.management.commands.demo import DEMO_DATASET, demo_rows, demo_spec
    from workers.runners.inputs import split_holdout

    spec = parse_spec(demo_spec())
    assert (spec.method, spec.env, spec.base_model, spec.dataset) == (
        "rl",
        "math",
        "tiny",
        DEMO_DATASET,
    )
    # Evaluated at step 0 and at the last step: held-out accuracy before and after.
    assert spec.eval_every == spec.steps
    # The tiny model's registry limits (jobs/0003): rank 64, context 1024.
    assert check_base_model_limits(spec, max_lora_rank=64, max_context=1024) == []
    rows = demo_rows()
    # The job holds out at most a fifth of the rows: all `eval_examples` fit, all distinct.
    train, held = split_holdout(rows, spec.eval_examples, spec.seed)
    assert len(held) == spec.eval_examples and len(train) >= spec.rollout.prompts_per_step
    assert len({r["question"] for r in rows}) == len(rows)
    assert all(set(r) == {"question", "answer"} and r["answer"].isdigit() for r in rows)
