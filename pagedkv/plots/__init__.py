"""Pictures drawn by code: the pool, page tables, sharing, and the simulation's plots (matplotlib)."""
