"""The cluster: Ray workers, their pool, placement, sharded (tensor-parallel / FSDP) workers."""
