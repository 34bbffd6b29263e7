"""jaxdist.testing."""
