"""Process groups: zero_ext's own groups and their pooling, what a
process_group argument resolves to (flat or a replica x shard mesh), and the
stall query a waiting rank sends its peers."""
