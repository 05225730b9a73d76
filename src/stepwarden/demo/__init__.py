"""The order-processing demo: fake remote services, the workflow that drives them, and the ledger check."""
