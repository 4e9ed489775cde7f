"""The worker child: the poll loop over stages, the abort signal and the context; its leases are
claimed and sealed through leasework.leases."""
