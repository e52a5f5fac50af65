"""Environments: the episode protocol, the 2x2 registry, built-in envs, sandbox, env tasks.

Everything except `tasks` and `apps` imports without Django.
"""
