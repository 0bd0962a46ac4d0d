"""torch.distributed.checkpoint (DCP) directories, written and read by
zero_ext over the same plan as its own format (files/plan.py): boxes.py
(flat ranges as DCP's rectangles), index.py (`.metadata` read through an
allowlist, written as torch writes it), layout.py (where entries sit:
get_state_dict's layout or torchtitan's), param_groups.py (each group's
parameters over every rank), save.py (what a rank writes, its data file,
rank 0's index files), reader.py (reading without trusting), load.py
(zero_ext.load's phases over a DCP directory). The public doors are
zero_ext.save(..., format="dcp") and zero_ext.load (files/entry.py); this
package never imports zero_ext's own format (checkpoint/)."""
