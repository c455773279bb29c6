"""Reference models built on jmem's transforms."""
