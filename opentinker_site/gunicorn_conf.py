"""gunicorn settings shared by docker-compose, the Dockerfile and ``manage.py serve --gunicorn``.

Threaded workers: the Tinker API's ``retrieve_future`` long polls hold a request open for
several seconds, which would tie up a whole sync worker each. ``--workers`` and ``--bind`` stay
on the command line.
"""

worker_class = "gthread"
threads = 32
# A request may wait on a long poll; the worker's own heartbeat is what this bounds.
timeout = 120
graceful_timeout = 30
