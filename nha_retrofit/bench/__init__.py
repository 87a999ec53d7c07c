"""`nha-retrofit bench`'s inputs and outputs: models built from a config alone with random weights, and the report
(JSON, markdown tables, PNG charts). The measurements themselves are in `eval/speed.py`."""
