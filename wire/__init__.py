"""The wire layer: what the router and the nodes say to each other, and who may say it.

messages.py holds the typed messages and their bounded msgpack codec, cluster_auth.py the
CURVE keys every cluster socket uses, limits.py the bounds on a request's numbers,
structured_output.py the shape of a structured output spec (checked by router and engine). This package
imports no torch and nothing of the engine, so the router process can use it without loading
model code (tests/architecture checks both).
"""
