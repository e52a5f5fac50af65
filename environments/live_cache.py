"""Live games of episodes that do not pickle (an interpreter, a JVM), kept per process.

The env queue parks episodes between turns as pickles: (game, actions so far), never the
running game. When the next turn of an episode lands on the process that played its last
one, the game is still here, checked against the action log, and no replay is needed; on
another process (or once evicted) the episode rebuilds the game by replaying its actions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar


class Live(Protocol):
    """A running game: the actions it was given, in order."""

    @property
    def actions(self) -> Sequence[str]: ...


L = TypeVar("L", bound=Live)


class LiveCache(Generic[L]):
    """The last `size` live games of this process, by episode key. `on_evict` is called on
    a game pushed out (None: dropped as it is, an episode of this process may still hold it)."""

    def __init__(self, size: int, on_evict: Callable[[L], None] | None = None) -> None:
        self.size = size
        self.on_evict = on_evict
        self._games: OrderedDict[str, L] = OrderedDict()
        self._lock = threading.Lock()
        self.replays = 0
        """Games under way this process rebuilt by replay (a cached one is reused instead)."""

    def remember(self, key: str, live: L) -> None:
        evicted = []
        with self._lock:
            self._games[key] = live
            self._games.move_to_end(key)
            while len(self._games) > self.size:
                evicted.append(self._games.popitem(last=False)[1])
        if self.on_evict is not None:
            for game in evicted:
                self.on_evict(game)

    def take(self, key: str, actions: Sequence[str]) -> L | None:
        """The episode's live game if it is here and at the same action."""
        with self._lock:
            live = self._games.get(key)
        return live if live is not None and list(live.actions) == list(actions) else None

    def forget(self, key: str) -> None:
        with self._lock:
            self._games.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._games.clear()


class Replaying(Generic[L]):
    """What an episode over a live game needs to pickle without it: the game stays out of
    the pickle (kept in this process's cache), and comes back from the cache or by replay.

    A subclass sets `key` and `_live` (None) in its constructor and gives its action log
    (`_log`), how to rebuild the game from it (`_rebuild`) and the cache (`_cache`)."""

    key: str
    _live: L | None

    def _cache(self) -> LiveCache[L]:
        raise NotImplementedError

    def _log(self) -> list[str]:
        raise NotImplementedError

    def _rebuild(self) -> L:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        if self._live is not None:
            self._cache().remember(self.key, self._live)
        state["_live"] = None
        return state

    def _live_game(self) -> L:
        live, log = self._live, self._log()
        if live is None or list(live.actions) != log:
            live = self._cache().take(self.key, log)
        if live is None:
            self._cache().replays += int(bool(log))
            live = self._rebuild()
        self._live = live
        return live
