"""kombu's Redis transport, made to survive the loss of its broker connection.

kombu 5.7 keeps using a channel after the consumer has dropped its connection: closing the
channel restores its unacknowledged messages, and a task that finishes afterwards acks its
message on it. Both build a Redis client from the connection, which is gone by then, and
fail with ``AttributeError`` (``'NoneType' object has no attribute 'hostname'`` or
``'client'``). kombu guards these calls against connection errors only, so the
AttributeError stops the worker ("Unrecoverable error") and every job it runs with it.

Here a channel whose connection is gone raises a connection error instead, which kombu
handles: the restore is skipped and the late ack is logged. Nothing is lost: the messages
stay in the broker's ``unacked`` hash until the visibility timeout, a job whose lease lapsed
meanwhile is requeued by the reaper, and a redelivered ``run_job`` whose lease token is no
longer current does nothing.
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kombu_redis

__all__ = ["Transport"]


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection is None or self.connection.client is None:
            raise redis.ConnectionError("this channel's broker connection is closed")
        params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel
