"""The run record: the ledger (ledger.py), the fields of its step lines (schema.py) and the fingerprints in them
(fingerprint.py), the config hash that names a run's numbers (identity.py), the run directory (rundir.py), the wandb
mirror and readers (wandb_io.py), and the live check against a reference run (reference.py)."""
