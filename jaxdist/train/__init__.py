"""jaxdist.train."""
