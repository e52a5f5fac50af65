"""Fully fine-tuned policies on the OpenAI-style endpoints.

A job that trained every weight leaves a whole model, not an adapter beside the base, so its
requests cannot share the base model's decode batch. The worker of the base model loads such
a model when a request first names it (the exported model directory, or a checkpoint's
training state put into the base's architecture) into an engine of its own that keeps the
base model's tokenizer and chat template, and runs its requests in a continuous batch of its
own, stepped in the same loop as the base model's. It holds at most
``OPENTINKER_OPENAI_FULL_MODELS`` of them; one idle for ``OPENTINKER_OPENAI_FULL_IDLE_SECONDS``
gives its memory back, and a request for another model waits while every model held is busy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tinker_api.worker.chat import ChatHandler, Stopped
from tinker_api.worker.meter import Shares, by_rows
from tinker_api.worker.requests import Op, RequestError
from tinker_api.worker.sampler_cache import SamplerCache
from training.engine import Engine
from training.model import load_base
from workers import conf

log = logging.getLogger(__name__)


def is_full(op: Op) -> bool:
    """Whether ``op`` names a fully fine-tuned policy (``services.serving``'s ``full`` target)."""
    target = op.fields.get("target")
    return isinstance(target, dict) and bool(target.get("full"))


def load_full(engine: Engine, file: str) -> Engine:
    """An engine over the whole model ``file`` names, on the base engine's device and dtype,
    with its tokenizer (and image processor): an exported model directory, or the
    ``state.pt`` of a checkpoint (its weights, without the optimizer moments)."""
    path = Path(file)
    dtype = next(engine.model.parameters()).dtype
    if path.suffix == ".pt":
        if not path.is_file():
            raise RequestError("the checkpoint's files are gone (deleted or rotated)")
        if engine.base_path is None:
            raise RuntimeError("this worker's base model was built in memory: no files to copy")
        state = torch.load(path, map_location="cpu", weights_only=True)
        weights = state.get("weights") or {}
        model, _ = load_base(engine.base_path, device=engine.device, dtype=dtype)
        params = dict(model.named_parameters())
        if set(weights) != set(params):
            raise RequestError("the checkpoint holds no full model of this base (a LoRA run?)")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(weights[name])
    else:
        if not (path / "config.json").is_file():
            raise RequestError("the job's model files are gone (deleted)")
        model, _ = load_base(path, device=engine.device, dtype=dtype)
    return Engine(model, tokenizer=engine.tokenizer, processor=engine.processor)


class FullModels:
    """The fully fine-tuned models one worker holds, each with its own ``ChatHandler``."""

    def __init__(
        self,
        base: str,
        engine: Engine,
        chat: ChatHandler,
        charge: Callable[[Shares, float], None],
    ) -> None:
        self.base = base
        self.engine = engine
        # The base model's handler answers the requests that cannot be loaded.
        self.chat = chat
        self.charge = charge
        # File -> its handler, least recently used first; when each went idle.
        self.handlers: dict[str, ChatHandler] = {}
        self.idle_since: dict[str, float] = {}
        # Requests for a model that is not held while every held one is busy, in arrival order.
        self.waiting: list[Op] = []
        self.capacity = conf.int_setting("OPENTINKER_OPENAI_FULL_MODELS", minimum=1)
        self.idle_seconds = conf.int_setting("OPENTINKER_OPENAI_FULL_IDLE_SECONDS", minimum=1)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(h.busy for h in self.handlers.values())

    def admit(self, ops: list[Op]) -> None:
        self.waiting.extend(ops)
        self._place()

    def _place(self) -> None:
        ops, self.waiting = self.waiting, []
        groups: dict[str, list[Op]] = {}
        for op in ops:
            groups.setdefault(str(op.fields["target"]["full"]), []).append(op)
        for file, group in groups.items():
            handler = self.handlers.get(file)
            if handler is None:
                if not self._make_room():
                    self.waiting.extend(group)
                    continue
                handler = self._load(file, group)
                if handler is None:
                    continue
            self.handlers.pop(file, None)
            self.handlers[file] = handler  # the most recently used last
            self.idle_since.pop(file, None)
            handler.admit(group)

    def _load(self, file: str, group: list[Op]) -> ChatHandler | None:
        started = time.perf_counter()
        try:
            engine = load_full(self.engine, file)
        except Exception as exc:
            for op in group:
                self.chat.refuse(op, exc)
            return None
        finally:
            # The load is the requests' that asked for the model.
            self.charge(by_rows(group), time.perf_counter() - started)
        log.info("worker of %s loaded the full model %s", self.base, file)
        return ChatHandler(self.base, engine, {}, SamplerCache(engine), charge=self.charge)

    def _make_room(self) -> bool:
        if len(self.handlers) < self.capacity:
            return True
        for file, handler in self.handlers.items():
            if not handler.busy:
                self._drop(file)
                return True
        return False

    def _drop(self, file: str) -> None:
        del self.handlers[file]
        self.idle_since.pop(file, None)
        log.info("worker of %s dropped the full model %s", self.base, file)
        if self.engine.device.type == "cuda":
            torch.cuda.empty_cache()

    def step(self) -> None:
        """One decode step of every busy model; models idle too long are dropped, and the
        requests that waited for room are placed."""
        now = time.monotonic()
        for file, handler in list(self.handlers.items()):
            if handler.busy:
                handler.step()
            if not handler.busy:
                since = self.idle_since.setdefault(file, now)
                if now - since > self.idle_seconds:
                    self._drop(file)
        if self.waiting:
            self._place()

    def fail_all(self, reason: str) -> None:
        for handler in self.handlers.values():
            handler.fail_all(reason)
        waiting, self.waiting = self.waiting, []
        for op in waiting:
            self.chat.refuse(op, Stopped(reason))
