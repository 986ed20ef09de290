"""Offload: optimizer state and stage-3 parameter shards in CPU memory or in files on NVMe."""
