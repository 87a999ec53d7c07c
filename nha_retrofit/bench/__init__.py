"""`nha-retrofit bench`: prefill, decode, memory and batch throughput of an NHA model against its original at its
best. `run.py` is what the command runs, `engine.py` the measurements, `decoders.py` the decode paths compared,
`timing.py` and `memory.py` how they are timed and sized, `report.py`, `plots.py` and `output.py` the report files,
`random_weights.py` models built from a config alone."""
