"""The worker child: the poll loop over stages, the lease, the abort signal and the context."""
