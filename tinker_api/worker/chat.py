"""The OpenAI-style requests of the model worker (``/v1/chat/completions``, ``/v1/completions``).

Chat requests share one continuous batch (``training.continuous``) across policies (the base
model and any number of adapters: each row is routed to its own). The worker loop advances it
one decode step per turn and admits the requests it has read since between two steps, so a
request that arrives while others decode starts at once, and Tinker requests are read and
run between steps too. Tinker sample requests decode in the same batch (the rows of a
``SamplingHandler``, which answers them): one forward serves both kinds. The prompt is
rendered here, with the base model's tokenizer and chat template, so the web process never
loads one. After each step the new text of a streaming request goes to its event stream
(``tinker_api.events``), its first text at once and then, with every other stream's, once
per ``OPENTINKER_OPENAI_STREAM_INTERVAL_MS`` (a choice's end at once), and the cancel keys
of the running requests are read in that round trip: a request whose client went away
leaves the batch within an interval, and its place in the queue limit is freed.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tinker_api import events, futures
from tinker_api.serving.toolcalls import TOOL_CALL_OPEN
from tinker_api.worker.chat_prompts import BadRequest, PromptRenderer
from tinker_api.worker.meter import Shares, by_rows
from tinker_api.worker.requests import Op, RequestError, fail_request, fitting
from tinker_api.worker.sampler_cache import SamplerCache
from tinker_api.worker.sampling import SampleRun, SamplingHandler
from tinker_api.worker.textstream import TextStream
from tinker_api.worker.token_text import TokenText
from training.continuous import ContinuousBatch, Row, StepToken
from training.engine import Engine
from training.policy import Policy
from training.sampler import default_stop_ids
from training.scoring import PromptScoring, score_prompts
from training.types import SamplingParams
from workers import conf

log = logging.getLogger(__name__)

UNLOADED = (
    "the weights this request samples were unloaded while it ran (their training session "
    "ended or their model was closed)"
)


class Stopped(RuntimeError):
    """The worker ends its requests (it stops): the reason is the client's to read."""


@dataclass(eq=False)
class Choice:
    index: int
    text: TextStream
    limit: int
    """Its max_tokens: a row that ends before it stopped (EOS, a stop string)."""
    finished: bool = False
    tokens: int = 0
    # Text and logprob entries not yet published (all of them, for a request that does not
    # stream: it gets them with the choice's end).
    unsent: str = ""
    # Logprob entries not yet published (all of them, for a request that does not stream).
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    # Entries of tokens whose text is not released yet (`TextStream.covered`), and how many
    # entries have moved on to ``logprobs``.
    pending: list[dict[str, Any]] = field(default_factory=list)
    entries_out: int = 0

    def release_entries(self) -> None:
        """Move the entries of the tokens the released text spells to ``logprobs``: the
        entries a client gets spell its text, no more."""
        ready = self.pending[: self.text.covered - self.entries_out]
        if ready:
            self.logprobs.extend(ready)
            del self.pending[: len(ready)]
            self.entries_out += len(ready)


@dataclass
class Echo:
    """An echoed prompt: its text and logprob entries, which come before the choice's own."""

    text: str
    entries: list[dict[str, Any]]


@dataclass(eq=False)
class Running:
    op: Op
    prompt_tokens: int
    choices: list[Choice]
    stream: bool
    want_logprobs: bool
    ended: bool = False
    sent_at: float = float("-inf")
    """When (time.monotonic) its stream's text last went out; -inf: never."""

    @property
    def rid(self) -> str:
        return self.op.rid

    @property
    def chat(self) -> bool:
        return self.op.fields.get("mode") == "chat"

    def usage(self) -> dict[str, int]:
        completion = sum(c.tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }


class ChatHandler:
    def __init__(
        self,
        base: str,
        engine: Engine,
        policies: Mapping[str, Policy],
        samplers: SamplerCache,
        charge: Callable[[Shares, float], None] = lambda _shares, _seconds: None,
        sampling: SamplingHandler | None = None,
    ) -> None:
        self.base = base
        # The Tinker sample requests, whose rows share the batch (the base model's handler).
        self.sampling = sampling
        # Where the time of each prefill (and echo scoring) and decode step goes: to the teams
        # of the requests it ran for (``Meter.charge``).
        self.charge = charge
        self.engine = engine
        self.policies = policies
        self.samplers = samplers
        self.tokenizer: Any = engine.tokenizer
        self.eos = set(default_stop_ids(engine.model, engine.tokenizer))
        self.token_text = TokenText(engine.tokenizer)
        self.render = PromptRenderer(base, engine)
        self.batch = ContinuousBatch(engine.model, engine.tokenizer, engine.host)
        # Row id -> the request and choice it generates; the requests in the batch; requests
        # read while a batch that cannot take new rows runs (a model without a joining
        # decoder): they start when it empties.
        self.owner: dict[int, tuple[Running, Choice]] = {}
        self.runs: list[Running] = []
        self.waiting: list[Op] = []
        self.stream_interval = conf.int_setting("OPENTINKER_OPENAI_STREAM_INTERVAL_MS", minimum=0)
        # Requests that would take the batch past this many rows wait for rows to leave: a
        # queue full of n=64 requests must not build a KV cache larger than the device.
        self.max_rows = conf.int_setting("OPENTINKER_TINKER_SAMPLE_BATCH_ROWS", minimum=1)
        self.ticked_at = float("-inf")

    @property
    def busy(self) -> bool:
        return bool(self.runs) or bool(self.waiting) or self._sampling_busy

    @property
    def _sampling_busy(self) -> bool:
        return self.sampling is not None and self.sampling.busy

    # ------------------------------------------------------------------ logprobs

    def row_teams(self) -> Counter[int | None]:
        """The rows in the batch per team (what a decode step's time is split by)."""
        teams = Counter(run.op.team for run, _choice in self.owner.values())
        if self.sampling is not None:
            teams.update(self.sampling.row_teams())
        return teams

    def _entry(self, step: StepToken, top: int) -> dict[str, Any]:
        alternatives = [(int(t), lp) for t, lp in (step.topk or [])[:top]]
        return self.token_text.entry(step.token, step.logprob, alternatives)

    def _echo(self, op: Op, prompts: list[list[int]], key: str | None) -> list[Echo]:
        """``echo``: each prompt's text and, with logprobs, an entry per prompt token (the
        first has no logprob: nothing precedes it), from one scoring forward pass."""
        f = op.fields
        top = int(f.get("top_logprobs") or 0)
        scores = (
            score_prompts(
                self.engine.model,
                [PromptScoring(tokens=p, adapter=key, logprobs=True, topk=top) for p in prompts],
                host=self.engine.host,
            )
            if f.get("logprobs")
            else [None] * len(prompts)
        )
        out = []
        for given, prompt, score in zip(f["prompts"], prompts, scores, strict=True):
            text = given if isinstance(given, str) else self.tokenizer.decode(prompt)
            entries = []
            if score is not None:
                lps, tops = score.logprobs or [], score.topk or []
                for i, token in enumerate(prompt):
                    top_i = None if i == 0 else (tops[i] if tops else [])
                    entries.append(self.token_text.entry(token, lps[i], top_i, in_text=True))
            out.append(Echo(text, entries))
        return out

    # ------------------------------------------------------------------ the batch

    def _end(self, run: Running, outcome: dict[str, Any]) -> None:
        """Complete ``run``'s future and free its place in the queue limit, once."""
        if run.ended:
            return
        run.ended = True
        # The place first: whoever sees the answer sees the place free.
        futures.samples_answered(self.base, 1)
        futures.complete(run.rid, json_body=json.dumps(outcome).encode())

    def refuse(self, op: Op, exc: Exception) -> None:
        if op.kind == "sample":
            self._refuse_sample(op, exc)
            return
        if isinstance(exc, BadRequest):
            event = {
                "t": "error",
                "status": 400,
                "message": str(exc),
                "param": exc.param,
                "code": exc.code,
            }
        elif isinstance(exc, RequestError):
            event = {"t": "error", "status": 400, "message": str(exc), "param": "model"}
        elif isinstance(exc, Stopped):
            event = {"t": "error", "status": 500, "message": str(exc)}
        else:
            log.exception("chat request %s failed", op.rid)
            # The exception's text describes the server, not the request: it stays in the log.
            message = f"the model worker failed on request {op.rid}; its log holds the cause"
            event = {"t": "error", "status": 500, "message": message}
        futures.samples_answered(self.base, 1)
        events.publish([(op.rid, event)])
        futures.fail(op.rid, str(event["message"]), "user" if event["status"] == 400 else "server")

    def _refuse_sample(self, op: Op, exc: Exception) -> None:
        """A Tinker sample request's error goes to its future (no event stream reads it)."""
        futures.samples_answered(self.base, 1)
        if isinstance(exc, Stopped):
            futures.fail(op.rid, str(exc), "server")
        else:
            fail_request(op, exc, "sample")

    def admit(self, ops: list[Op]) -> None:
        """Put the requests ``ops`` in the batch (or refuse them, each alone)."""
        if len(self.batch) and not self.batch.can_join:
            self.waiting.extend(ops)
            return
        ops, self.waiting = self.waiting + ops, []
        taken = fitting(ops, self.max_rows - len(self.batch), at_least_one=not len(self.batch))
        ops, self.waiting = ops[:taken], ops[taken:]
        if not ops:
            return
        started = time.perf_counter()
        try:
            self._admit(ops)
        finally:
            # The prefill and any echo's scoring are the joining requests' alone, whether
            # they joined from the worker loop or from a step (requests that waited).
            self.charge(by_rows(ops), time.perf_counter() - started)

    def _admit(self, ops: list[Op]) -> None:
        gone = events.cancelled(op.rid for op in ops if op.kind != "sample")
        admitted: list[tuple[Running | SampleRun, list[Row]]] = []
        for op in ops:
            if op.rid in gone:
                futures.samples_answered(self.base, 1)
                futures.complete(op.rid, json_body=b'{"cancelled": true}')
                continue
            try:
                admitted.append(self._prepare(op) if op.kind != "sample" else self._sample(op))
            except Exception as exc:
                self.refuse(op, exc)
        if not admitted:
            return
        rows = [row for _run, run_rows in admitted for row in run_rows]
        try:
            idents = self.batch.add(rows) if rows else []
        except Exception as exc:
            log.exception("chat prefill failed")
            for run, _rows in admitted:
                self.refuse(run.op, exc)
            return
        at = 0
        for run, run_rows in admitted:
            mine, at = idents[at : at + len(run_rows)], at + len(run_rows)
            if isinstance(run, SampleRun):
                assert self.sampling is not None
                self.sampling.joined(run, mine)
            else:
                live = [c for c in run.choices if not c.finished]
                self.owner.update(zip(mine, [(run, c) for c in live], strict=True))
        chats = [(run, rr) for run, rr in admitted if isinstance(run, Running)]
        self._started(chats)

    def _sample(self, op: Op) -> tuple[SampleRun, list[Row]]:
        if self.sampling is None:
            raise RequestError("this model serves no Tinker sample requests")
        try:
            run, rows = self.sampling.prepare(op)
            for row in rows:
                self.batch.check(row)
        except (ValueError, KeyError) as exc:
            # A field the web process let through that cannot run here: the caller's error.
            raise RequestError(str(exc)) from exc
        if not rows:
            raise RequestError("num_samples: at least one sample is needed")
        return run, rows

    def _started(self, admitted: list[tuple[Running, list[Row]]]) -> None:
        """Announce the chat requests that joined; answer those with nothing to generate."""
        self.runs.extend(run for run, run_rows in admitted if run_rows)
        events.publish([(run.rid, self._start(run)) for run, _ in admitted])
        # Requests with nothing to generate (max_tokens 0) are answered now.
        answered = [run for run, run_rows in admitted if not run_rows]
        events.publish([(run.rid, event) for run in answered for event in self._answer(run)])
        for run in answered:
            self._end(run, {"usage": run.usage()})

    def _answer(self, run: Running) -> list[dict[str, Any]]:
        """The events of a request that generates nothing: each choice's echo, and usage."""
        out: list[dict[str, Any]] = [
            {
                "t": "end",
                "i": c.index,
                "text": c.unsent,
                "lp": c.logprobs,
                "finish_reason": "length",
            }
            for c in run.choices
        ]
        return [*out, {"t": "done", "usage": run.usage()}]

    def _start(self, run: Running) -> dict[str, Any]:
        event: dict[str, Any] = {"t": "start", "prompt_tokens": run.prompt_tokens}
        # The view parses <tool_call> blocks only where the template taught that format and
        # the request offered tools; elsewhere tool calls stay text.
        if run.op.fields.get("mode") == "chat" and run.op.fields.get("tools"):
            template = getattr(self.tokenizer, "chat_template", None) or ""
            event["tools"] = isinstance(template, str) and TOOL_CALL_OPEN in template
        return event

    def _prepare(self, op: Op) -> tuple[Running, list[Row]]:
        f = op.fields
        key = self.samplers.key(f["target"], self.policies)
        rendered = self.render.prompts(op)
        prompts = rendered.tokens
        sp = f["params"]
        stop = tuple(str(s) for s in sp.get("stop") or ())
        top = int(f.get("top_logprobs") or 0)
        n = int(f["n"])
        run = Running(
            op=op,
            prompt_tokens=sum(len(p) for p in prompts),
            choices=[],
            stream=bool(f.get("stream")),
            want_logprobs=bool(f.get("logprobs")),
        )
        echoes = self._echo(op, prompts, key) if f.get("echo") else [None] * len(prompts)
        rows = []
        for i, prompt in enumerate(prompts):
            limit = self.render.max_tokens(op, prompt)
            if limit == 0:
                # Nothing to generate (an echo of the prompt, scored): no row.
                for j in range(n):
                    run.choices.append(self._choice(i * n + j, 0, stop, echoes[i], done=True))
                continue
            params = SamplingParams(
                max_tokens=limit,
                temperature=float(sp["temperature"]),
                top_p=float(sp["top_p"]),
                seed=sp.get("seed"),
                stop=stop,
                frequency_penalty=float(sp.get("frequency_penalty") or 0.0),
                presence_penalty=float(sp.get("presence_penalty") or 0.0),
                logit_bias=tuple(
                    (int(t), float(b)) for t, b in (sp.get("logit_bias") or {}).items()
                ),
            )
            for j in range(n):
                eos = not sp.get("ignore_eos")
                row = Row(
                    prompt,
                    params,
                    key,
                    sample_index=j,
                    stop_on_eos=eos,
                    topk=top,
                    images=rendered.images[i],
                )
                try:
                    self.batch.check(row)
                except ValueError as exc:
                    where = "messages" if f["mode"] == "chat" else "prompt"
                    if str(exc).startswith("logit_bias"):
                        where = "logit_bias"
                    raise BadRequest(str(exc), where) from exc
                rows.append(row)
                run.choices.append(self._choice(i * n + j, limit, stop, echoes[i]))
        return run, rows

    def _choice(
        self, index: int, limit: int, stop: tuple[str, ...], echo: Echo | None, done: bool = False
    ) -> Choice:
        choice = Choice(index=index, text=TextStream(self.tokenizer, stop), limit=limit)
        if echo is not None:
            choice.unsent, choice.logprobs = echo.text, list(echo.entries)
        choice.finished = done
        return choice

    def step(self) -> None:
        """One decode step of the batch, published; finished and abandoned requests leave."""
        if not len(self.batch):
            self._forget()
            if self.waiting:
                self.admit([])
            return
        self._refuse_unloaded()
        if not len(self.batch):
            return
        # A decode step is its rows', by their rows; requests admitted after it charge their
        # own prefill (``admit``).
        shares, started = self.row_teams(), time.perf_counter()
        sampled: list[SampleRun] = []
        try:
            steps = self.batch.step()
            if self.sampling is not None:
                mine = self.sampling.owner
                ours = [s for s in steps if s.row in mine]
                steps = [s for s in steps if s.row not in mine]
                sampled = self.sampling.on_step(ours)
            drop = self._on_step(steps)
        except Exception as exc:
            log.exception("chat batch failed")
            self.fail_all(exc)
            return
        finally:
            self.charge(shares, time.perf_counter() - started)
        if drop:
            self.batch.drop(drop)
        if sampled:
            assert self.sampling is not None
            # Answering (and any prompt scoring) is the finished requests' alone.
            started = time.perf_counter()
            try:
                self.sampling.finish(sampled)
            finally:
                self.charge(by_rows(run.op for run in sampled), time.perf_counter() - started)
        self._forget()
        if self.waiting and self.batch.can_join and len(self.batch) < self.max_rows:
            self.admit([])

    def adapters_in_use(self) -> set[str]:
        """The host keys the batch's rows decode with (``SamplerCache.trim`` keeps them)."""
        return {row.key for row in self.batch.rows if row.key is not None}

    def _refuse_unloaded(self) -> None:
        """End the requests whose adapter left the host while they ran (their policy closed):
        routing the batch through a missing adapter would fail every request in it."""
        host = self.engine.host
        gone = {row.ident for row in self.batch.rows if row.key is not None and row.key not in host}
        if not gone:
            return
        runs = {id(run): run for ident, (run, _c) in self.owner.items() if ident in gone}
        for run in runs.values():
            if not run.ended:
                run.ended = True
                self.refuse(run.op, RequestError(UNLOADED))
        drop = {ident for ident, (run, _c) in self.owner.items() if id(run) in runs}
        if self.sampling is not None:
            drop |= self.sampling.fail(self.sampling.runs_of(gone), UNLOADED, "user")
        self.batch.drop(drop)
        self._forget()

    def _forget(self) -> None:
        """Stop tracking the requests that have ended and their rows."""
        self.runs = [run for run in self.runs if not run.ended]
        live = {id(run) for run in self.runs}
        self.owner = {k: v for k, v in self.owner.items() if id(v[0]) in live}
        if not self.runs and not self._sampling_busy and len(self.batch):
            self.batch.drop({row.ident for row in self.batch.rows})

    def fail_all(self, exc: Exception | str) -> None:
        """End every request in the batch or waiting for it with an error (the worker stops,
        or the batch failed)."""
        error = exc if isinstance(exc, Exception) else Stopped(exc)
        for run in self.runs:
            if not run.ended:
                run.ended = True
                self.refuse(run.op, error)
        for op in self.waiting:
            self.refuse(op, error)
        self.waiting = []
        if self.sampling is not None:
            reason = f"{type(error).__name__}: {error}"
            self.sampling.fail_all(str(error) if isinstance(error, Stopped) else reason)
        self.runs, self.owner = [], {}
        self.batch = ContinuousBatch(self.engine.model, self.engine.tokenizer, self.engine.host)

    def _on_step(self, steps: list[StepToken]) -> set[int]:
        """Publish what ``steps`` produced; the rows to drop (cut at a stop string, or their
        client gone)."""
        owner, runs = self.owner, self.runs
        deltas: dict[str, list[dict[str, Any]]] = {}
        ends: list[tuple[str, dict[str, Any]]] = []
        finished_runs: list[Running] = []
        drop: set[int] = set()
        # The streams whose text goes out this step: their first at once, then everyone's
        # together once per interval, when the cancel keys are read too. Steps between two
        # ticks publish only first texts and ends, and most of them nothing at all: a round
        # trip to Redis per decode step would cost the worker as much as a tenth of its time.
        now = time.monotonic()
        tick = (now - self.ticked_at) * 1000.0 >= self.stream_interval
        if tick:
            self.ticked_at = now
        due = {run.rid for run in runs if tick or run.sent_at == float("-inf")}
        for step in steps:
            run, choice = owner[step.row]
            if run.ended or choice.finished:
                continue
            choice.tokens += 1
            choice.unsent += choice.text.push(step.token)
            at_eos = step.token in self.eos and not run.op.fields["params"].get("ignore_eos")
            if run.want_logprobs and not (step.finished and at_eos and run.chat):
                # Chat: the end of the turn is no content, so no entry (OpenAI's entries spell
                # the content). The legacy form keeps it, as OpenAI's and vLLM's do: lm-eval
                # reads the prompt's entries as all but the last of an echo with max_tokens 1.
                choice.pending.append(self._entry(step, int(run.op.fields.get("top_logprobs", 0))))
            if step.finished or choice.text.stopped:
                if not step.finished:
                    # Cut at a stop string the batch has not seen yet (it looks at a window
                    # of raw tokens): the row leaves the batch here.
                    drop.add(step.row)
                choice.finished = True
                text = choice.unsent + choice.text.finish()
                choice.release_entries()
                stopped = choice.text.stopped or at_eos or choice.tokens < choice.limit
                end: dict[str, Any] = {
                    "t": "end",
                    "i": choice.index,
                    "text": text,
                    "lp": choice.logprobs,
                    "finish_reason": "stop" if stopped else "length",
                }
                if run.op.fields.get("token_ids"):
                    # The job sample endpoint answers with the generated ids, as its contract
                    # always has (stop token included).
                    end["tokens"] = list(choice.text.tokens)
                ends.append((run.rid, end))
                choice.unsent, choice.logprobs = "", []
                if all(c.finished for c in run.choices):
                    finished_runs.append(run)
                continue
            choice.release_entries()
            if run.stream and run.rid in due and (choice.unsent or choice.logprobs):
                deltas.setdefault(run.rid, []).append(
                    {"i": choice.index, "text": choice.unsent, "lp": choice.logprobs}
                )
                choice.unsent, choice.logprobs = "", []
        # Deltas before ends: a client reads a choice's last text before its finish reason.
        for run in runs:
            if run.rid in deltas:
                run.sent_at = now
        ordered = [(rid, {"t": "delta", "c": d}) for rid, d in deltas.items()] + ends
        ordered += [(run.rid, {"t": "done", "usage": run.usage()}) for run in finished_runs]
        watch = [run.rid for run in runs if tick and not run.ended and run not in finished_runs]
        gone = events.publish(ordered, watch=watch)
        for run in finished_runs:
            self._end(run, {"usage": run.usage()})
        for run in runs:
            if run.rid in gone and not run.ended:
                log.info("chat request %s: the client went away, generation stopped", run.rid)
                self._end(run, {"cancelled": True, "usage": run.usage()})
        if gone:
            drop |= {row for row, (run, _c) in owner.items() if run.rid in gone}
        return drop
