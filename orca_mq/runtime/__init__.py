"""Where a process computes: the node of each worker (placement.py, without torch), its device
(device.py) and its threads' intra-op thread counts (threads.py). Below the KV layer and the engine,
which both use it; it imports nothing of orca_mq but the config's type."""
