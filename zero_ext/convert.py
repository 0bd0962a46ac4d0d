"""`python -m zero_ext.convert`: the command line of zero_ext/files/convert.py
(a checkpoint, zero_ext's own or any DCP directory, into a state_dict file or
safetensors, or --verify)."""
from .files import convert
from .files import convert_main as main

__all__ = ["convert", "main"]

if __name__ == "__main__":
    main()
