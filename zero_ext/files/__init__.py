"""What zero_ext reads and writes on disk: sharded checkpoints (save, load,
the format and how reading distrusts it, convert), safetensors, and a
model's weights in and out (load_weights, save_weights). README.md beside
this follows one checkpoint from save to load."""
