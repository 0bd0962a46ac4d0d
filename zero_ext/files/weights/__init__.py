"""A model's weights in and out in the formats the ecosystem reads:
load_weights (a state dict, .safetensors, .pt/.bin, a Hugging Face index:
each rank reads only its own ranges), save_weights (safetensors that
transformers.from_pretrained reads, one unit at a time), and the safetensors
reader and writer they share with convert."""
