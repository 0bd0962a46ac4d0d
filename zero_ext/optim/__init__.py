"""The optimizer side: the user's optimizer re-pointed at zero_ext's shards,
gradient clipping over sharded gradients, and the CPU Adam kernel."""
