"""Server-rendered pages for teams, one module per idea (zulip's ``views/`` layout).

Every object is fetched through a queryset filtered by the user's teams (``common.team_job``
and friends), so a job, key or dataset of another team answers 404 exactly like a missing
one. Pages never write the ORM: state changes go through ``jobs.services``,
``jobs.datasets``, ``accounts.keys`` and ``accounts.teams`` (``web.actions`` composes them
where a page needs several steps); the views only translate their exceptions into messages
beside the fields.
"""
