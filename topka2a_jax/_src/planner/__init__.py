"""Which exchange each bucket takes: the cost model and the bucket plan."""
