"""Capacity planning from measured speeds: `pdserve profile` measures one node's step times on
this device (profile.py), `pdserve plan --workload` simulates a workload on every layout
(simulator.py) and ranks layouts, chunk sizes and placement thresholds by goodput per device
(search.py)."""
