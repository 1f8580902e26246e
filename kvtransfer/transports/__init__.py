"""KV transports: shm, cuda_ipc and zmq, and the inprocess test double (see base.py for the
interface, registry.py for the names)."""
