"""The model worker: one long-running task per base model that executes Tinker requests.

The task ``tinker_api.serve_base_model`` (``tinker_api.tasks``) runs on a GPU worker inside a
block leased from the lock table. It loads the base model once (``training.Engine``) and
serves every LoRA created on it, reading requests from the Redis stream of its base model
(``server``). Requests of one model run in ``seq_id`` order (``ordering``: a later one waits
until the gap fills); forward/backward requests that are ready at the same time, across
models and chunks, run as ONE engine call through the multi-LoRA path, each request keeping
its own loss and metrics (``handlers``); sample requests decode in the worker's one
multi-adapter continuous batch beside the OpenAI-style requests (``chat`` steps it,
``sampling`` turns a request into rows and answers it; adapters from ``sampler_cache``).

Results go to the request's future (``tinker_api.futures``). A worker heartbeats its lease
and its ``alive`` key; when it dies, polls of the futures it had claimed fail with a clear
error, and the next worker rebuilds each model from its last saved state (``policies``).
This package imports torch: only the task imports it, when a model worker starts.
"""
