"""Sharded optimizer state (ZeRO): layouts, sharded storage, the sharded update."""
