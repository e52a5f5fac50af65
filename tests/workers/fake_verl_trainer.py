"""Stands in for ``python -m verl.trainer.main_ppo`` in the verl runner's process tests.

It reads the Hydra overrides the runner passes (``key=value``), starts a child process (as
verl starts Ray and vLLM), and for each of ``trainer.total_training_steps`` prints a metric
line in verl's console format, with Ray's prefix, and saves ``global_step_N`` checkpoints in
``trainer.default_local_dir`` every ``trainer.save_freq`` steps and at the end, writing
``latest_checkpointed_iteration.txt`` after each save as verl does.

``FAKE_VERL_MODE``: ``finish`` (exit 0), ``fail`` (exit 3 after step 1), ``hang`` (after
step 1 the leader and its child ignore SIGTERM and wait forever). The child's pid goes to
``$FAKE_VERL_PIDS`` (leader pid, then child pid). ``$FAKE_VERL_SHM``: the leader maps a
``/dev/shm`` file of that name and never removes it (as vLLM's queues do when killed).
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    overrides = dict(arg.split("=", 1) for arg in sys.argv[1:] if "=" in arg)
    mode = os.environ.get("FAKE_VERL_MODE", "finish")
    steps = int(overrides["trainer.total_training_steps"])
    save_freq = int(overrides["trainer.save_freq"])
    ckpt = Path(overrides["trainer.default_local_dir"])
    for key in ("data.train_files", "data.val_files"):
        if not Path(overrides[key]).is_file():
            print(f"missing {key}: {overrides[key]}", flush=True)
            return 2
    if mode == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    segment = None
    if os.environ.get("FAKE_VERL_SHM"):
        fd = os.open(f"/dev/shm/{os.environ['FAKE_VERL_SHM']}", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        segment = mmap.mmap(fd, 4096)
    child_code = (
        "import signal, time\n"
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if mode == "hang" else "")
        + "time.sleep(600)\n"
    )
    # The child inherits the process group, like verl's Ray workers.
    child = subprocess.Popen([sys.executable, "-c", child_code])
    pids = os.environ.get("FAKE_VERL_PIDS")
    if pids:
        Path(pids).write_text(f"{os.getpid()}\n{child.pid}\n")
    print("Started a local Ray instance.", flush=True)
    start = int(overrides.get("fake.start_step", "1"))
    latest = ckpt / "latest_checkpointed_iteration.txt"
    if latest.is_file():
        start = int(latest.read_text()) + 1
    for step in range(start, steps + 1):
        print(
            f"(TaskRunner pid={os.getpid()}) step:{step}"
            f" - critic/score/mean:np.float64({step / 10})"
            f" - actor/pg_loss:{-step / 100} - actor/entropy:nan - timing_s/step:0.01"
            f" - training/global_step:{step}",
            flush=True,
        )
        if save_freq > 0 and (step % save_freq == 0 or step == steps):
            (ckpt / f"global_step_{step}" / "actor").mkdir(parents=True, exist_ok=True)
            latest.write_text(str(step))
        if mode == "fail":
            print("RuntimeError: CUDA out of memory", flush=True)
            child.kill()
            return 3
        if mode == "hang":
            while True:
                time.sleep(1)
    child.kill()
    child.wait()
    del segment
    return 0


if __name__ == "__main__":
    sys.exit(main())
