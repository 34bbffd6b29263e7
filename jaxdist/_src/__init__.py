"""jaxdist's private implementation: import the public modules (``jaxdist``, ``jaxdist.keras``,
``jaxdist.train`` ...) instead; nothing under ``jaxdist._src`` is a stable API."""
