"""jaxdist.ps."""
