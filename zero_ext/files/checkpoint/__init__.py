"""zero_ext's own checkpoint format: zero_ext.save / zero_ext.load, sharded,
atomic, checksummed, loadable at any world size and stage, and converted to
other formats by `python -m zero_ext.convert`. The parts: save.py and load.py
(the collective phases), format.py (the files' bytes), metadata.py (the index,
typed and sealed), checksum.py, reader.py (reading without trusting),
publish.py (one atomic step; finding the last save), convert.py. Which ranges
a rank writes and reads is files/plan.py, shared with the weights. A second
format (DCP) is a sibling package over the same plan."""
