"""Server-rendered team pages (Django templates + htmx).

Pages read the ORM and never write it: every change goes through a services module
(``jobs.services``, ``jobs.datasets``, ``accounts.keys``, ``accounts.teams``); see
``web.views``.
"""
