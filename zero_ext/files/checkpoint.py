"""zero_ext.save / zero_ext.load: sharded, atomic, checksummed, loadable at
any world size and stage. The parts: save.py and load.py (the collective
phases), plan.py (which ranges a rank writes and reads), format.py (the
files' bytes), metadata.py (the index, typed and sealed), reader.py
(reading without trusting), publish.py (one atomic step; finding the last
save), collective.py (a failure on one rank reaches every rank)."""
from .load import load
from .save import save

__all__ = ["load", "save"]
