"""The wire layer: what every process (router, nodes, launcher) shares, and who may say what.

messages.py holds the typed messages and their bounded msgpack codec, cluster_auth.py the
CURVE keys every cluster socket uses, limits.py the bounds on a request's numbers,
structured_output.py the shape of a structured output spec (checked by router and engine),
log_format.py every process's logging set-up, config_flags.py the command-line flags generated
from a config dataclass's fields. This package imports no torch and nothing of the engine, so
the router process can use it without loading model code (tests/architecture checks both).
"""
