"""zero_ext's own checkpoint format: sharded, atomic, checksummed, loadable
at any world size and stage, and converted to other formats by `python -m
zero_ext.convert`. The parts: save.py and load.py (what each collective
phase does in this format; files/entry.py is the door that picks it),
format.py (the files' bytes), metadata.py (the index, typed and sealed:
fields.py reads its JSON fields, pieces.py types its pieces,
metadata_checks.py relates its parts), reader.py (reading without
trusting), publish.py (one atomic step, for DCP saves too; finding the last
save), convert.py, checksum.py (files/checksum.py, by this format's name).
Which ranges a rank writes and reads is files/plan.py, shared with the
weights and with DCP (dcp/, a sibling this package never imports)."""
