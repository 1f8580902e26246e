"""KV transports: shm, cuda_ipc and zmq (see base.py for the interface)."""
