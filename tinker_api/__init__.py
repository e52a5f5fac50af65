"""The Tinker wire protocol: what the official ``tinker`` SDK sends and expects back.

``wire`` decodes forward/backward bodies and encodes forward/backward and sampling results;
``schemas`` holds the pydantic models of the JSON endpoints; ``PROTOCOL.md`` lists every
endpoint the SDK and the cookbook call. Nothing here imports the ``tinker`` package.
"""
