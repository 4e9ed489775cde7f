"""The supervisor: the parent process of `leasework supervise` (`parent.py`), what each forked
child does (`child.py`), the liveness pipe between them (`liveness.py`), the parent's database
duties (`hostdb.py`) and its pure decisions (`policy.py`). Never runs job code in the parent."""
