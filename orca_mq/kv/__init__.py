"""The KV manager, in one place: the pool's size (pool.py), the scheduler's block manager for the
device and host tiers (block_manager.py, over the block tables and the copies between the tiers in
tables.py), FastServe's KV policies (policy.py), a stage's KV tensors (cache.py) and the swapper
that applies a plan's copies between its tiers (swapper.py). What it reads of a request is request.py's
KVRequest: it imports nothing of the scheduler or the engine."""
