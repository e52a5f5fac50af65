"""GPU lock table, dispatcher, reaper, job runners and the Celery tasks that tie them together.

Redis is the authority on GPU ownership (``workers.locktable``); the database only mirrors it
(``GpuLeaseRecord``) and job state changes go through ``jobs.services``.
"""
